// GGUF formats by panels of 16 weight rows in int8, for steps of many rows: each panel
// unpacked once (gguf_panel.h: a unit's bytes transposed, 4 bytes of each of the 16 rows a
// dword), then each unit's 16 x rows integer dot products, from AMX's tiles (TDPBSUD;
// gguf_amx.h) where the process may use them, else from AVX-512 VNNI (VPDPBUSD, one dword of
// x broadcast against the unit's tile rows). Each product is scaled by its unit's d (and its
// offset times the rounded x's sum) as the VNNI kernels scale it, unit u in lane u % 16, the
// lanes summed in _mm512_reduce_add_ps's order. The 32-weight formats (Q8_0, Q4_0, Q4_1,
// Q5_0, Q5_1, planar) take gguf_dot32.h's unsigned bytes: where a row holds whole rounds of
// 16 blocks (in_features a multiple of 512) every output equals dot32's bit for bit. dot32
// sums its last nb % 16 blocks in partial sums of 4 weights (cheaper for a few blocks than
// whole ones); here each is one sum, so such rows differ from dot32's in float32 rounding
// alone. The K-quants (Q4_K, Q5_K, Q6_K, in the file's layout) scale each sub-block's sum in
// float, where gguf_kdot.h sums a block's sub-blocks in integers first: the same products,
// apart by float32 rounding alone. AMX and VNNI give the same integers, so the same outputs.

#pragma once

#include "gguf_amx.h"
#include "gguf_panel.h"

#ifdef TIDAL_GGUF_DOT32
#include <algorithm>
#include <cstring>
#include <optional>
#include <type_traits>
#include <vector>

namespace tidal_cpu {
namespace gguf {

// Lane l's units (l, l + 16, l + 32, ...) one after another: dot32 sums block b in lane b % 16,
// so taking a lane's units together keeps its accumulators in registers, in dot32's order
// (panel_rows walks them so; AMX issues its tile products ahead from this list).
inline std::vector<int32_t> lane_order(int64_t nu) {
  std::vector<int32_t> order;
  for (int l = 0; l < 16; ++l)
    for (int64_t u = l; u < nu; u += 16) order.push_back(static_cast<int32_t>(u));
  return order;
}

// The activations' scales d and sums sum32 by tile of 16 rows and unit of `width` weights:
// [tile][unit][16], read a row at a time as broadcasts; a last tile's missing rows are 0.
// Units of 16 (Q6_K's: signed, without offsets) need no sums, but VNNI, which multiplies
// unsigned weights, takes q - 32 as q and subtracts 32 times x's integer sum (`xsum`).
struct RowScales {
  std::vector<float> d, sum32;
  std::vector<int32_t> xsum;
  RowScales(const Activations& a, int64_t rows, int width) {
    const int64_t ng = a.k / kGroup, nu = a.k / width, tiles = (rows + 15) / 16;
    d.assign(tiles * nu * 16, 0.f);
    sum32.assign(width == kGroup ? tiles * nu * 16 : 0, 0.f);
    xsum.assign(width == kGroup ? 0 : tiles * nu * 16, 0);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t u = 0; u < nu; ++u) {
        const int64_t at = ((r / 16) * nu + u) * 16 + r % 16, g = r * ng + u * width / kGroup;
        d[at] = a.d[g];
        if (width == kGroup) {
          sum32[at] = a.sum32[g];
        } else {
          const int8_t* q = &a.q[r * a.k + u * width];
          for (int i = 0; i < width; ++i) xsum[at] += q[i];
        }
      }
  }
};

// A step's RowScales, built once for each unit width its parts take (32: the 32-weight
// formats, Q4_K and Q5_K; 16: Q6_K), not once a part (a fused q/k/v has three).
class StepScales {
 public:
  StepScales(const Activations& a, int64_t rows) : a_(a), rows_(rows) {}
  const RowScales& of(int width) {
    std::optional<RowScales>& s = by_[width == kGroup ? 0 : 1];
    if (!s) s.emplace(a_, rows_, width);
    return *s;
  }

 private:
  const Activations& a_;
  int64_t rows_;
  std::optional<RowScales> by_[2];
};

// A unit's integer dot products by VNNI: its tile rows (4 weights of each of the 16 weight
// rows a dword) in registers, each activation row's dwords of x broadcast against them.
template <int kWidth, bool kSigned>
struct VnniProducts {
  const int8_t* x;  // the first row's q
  int64_t k;
  int n;                // rows (NR may be more)
  const Panel& p;
  const int32_t* xsum;  // kSigned: x's integer sums, unit u's row r at 16 u + r
  __m512i w[kWidth / 4];
  int64_t u = 0;

  void unit(int64_t, int64_t u_) {
    u = u_;
    for (int i = 0; i < kWidth / 4; ++i) {
      w[i] = _mm512_loadu_si512(&p.tiles[(u * kWidth / 4 + i) * 64]);
      if constexpr (kSigned) w[i] = _mm512_add_epi8(w[i], _mm512_set1_epi8(32));  // q
    }
  }
  // The unit's sums for rows 0 .. NR - 1, the rows' products interleaved: NR chains of dot
  // products in flight, not one. Rows past n repeat row n - 1 (their scales are zero).
  template <int NR>
  void rows(__m512i* sums) const {
    const int8_t* xr[NR];
    for (int r = 0; r < NR; ++r) xr[r] = x + std::min(r, n - 1) * k + u * kWidth;
    for (int r = 0; r < NR; ++r) sums[r] = _mm512_setzero_si512();
    for (int i = 0; i < kWidth / 4; ++i)
      for (int r = 0; r < NR; ++r) {
        int32_t dword;
        std::memcpy(&dword, xr[r] + 4 * i, 4);
        sums[r] = _mm512_dpbusd_epi32(sums[r], w[i], _mm512_set1_epi32(dword));
      }
    if constexpr (kSigned)
      for (int r = 0; r < NR; ++r)
        sums[r] = _mm512_sub_epi32(sums[r], _mm512_set1_epi32(32 * xsum[16 * u + r]));
  }
};

// NR rows (NR >= nr; those past nr have zero scales and are not stored) against a panel of
// nu units: out[r] (16 floats, the panel's rows), each unit's products from `products`
// (unit(i, u): the i-th unit in lane order is u; rows<NR>(sums): its sums for each row). Row
// r's scales: unit u's at dx[16 u + r] and sx[16 u + r] (RowScales' rows of a tile).
template <int NR, bool kSigned, typename Products>
inline void panel_rows(const float* dx, const float* sx, int nr, const Panel& p, int64_t nu,
                       Products& products, float* out) {
  alignas(64) float acc[16][NR][16];  // [lane][row][weight row], dot32's accumulators
  int64_t i = 0;
  for (int l = 0; l < 16; ++l) {
    __m512 s[NR];
    for (int r = 0; r < NR; ++r) s[r] = _mm512_setzero_ps();
    for (int64_t u = l; u < nu; u += 16, ++i) {
      products.unit(i, u);
      const __m512 d = _mm512_loadu_ps(&p.d[u * 16]), off = _mm512_loadu_ps(&p.off[u * 16]);
      __m512i sums[NR];
      products.template rows<NR>(sums);
      for (int r = 0; r < NR; ++r) {
        const __m512 sum = _mm512_cvtepi32_ps(sums[r]);
        const __m512 with_off =
            kSigned ? s[r] : _mm512_fmadd_ps(off, _mm512_set1_ps(sx[16 * u + r]), s[r]);
        s[r] = _mm512_fmadd_ps(sum, _mm512_mul_ps(d, _mm512_set1_ps(dx[16 * u + r])), with_off);
      }
    }
    for (int r = 0; r < NR; ++r) _mm512_store_ps(acc[l][r], s[r]);
  }
  for (int r = 0; r < nr; ++r) {  // _mm512_reduce_add_ps's tree: lanes i + 8, i + 4, i + 2, i + 1
    __m512 s[8];
    for (int i = 0; i < 8; ++i)
      s[i] = _mm512_add_ps(_mm512_load_ps(acc[i + 8][r]), _mm512_load_ps(acc[i][r]));
    for (int i = 0; i < 4; ++i) s[i] = _mm512_add_ps(s[i + 4], s[i]);
    for (int i = 0; i < 2; ++i) s[i] = _mm512_add_ps(s[i + 2], s[i]);
    _mm512_storeu_ps(out + 16 * r, _mm512_add_ps(s[0], s[1]));
  }
}

// A tile of nr (1 .. 16) rows by VNNI, in 8-row halves: 8 accumulators and a unit's tile rows
// stay in registers.
template <int kWidth, bool kSigned>
inline void vnni_tile_rows(const Activations& a, const RowScales& rs, int64_t r0, int nr,
                           const Panel& p, int64_t nu, float* out) {
  for (int h = 0; h < nr; h += 8) {  // rows r0 + h ..: the tile's scales from lane h on
    const int n = std::min(8, nr - h);
    const int64_t at = r0 * nu + h;
    VnniProducts<kWidth, kSigned> products{&a.q[(r0 + h) * a.k], a.k, n, p,
                                           kSigned ? &rs.xsum[at] : nullptr};
    const float* dx = &rs.d[at];
    const float* sx = kSigned ? nullptr : &rs.sum32[at];
    if (n <= 4) panel_rows<4, kSigned>(dx, sx, n, p, nu, products, out + 16 * h);
    else panel_rows<8, kSigned>(dx, sx, n, p, nu, products, out + 16 * h);
  }
}


#ifdef TIDAL_GGUF_AMX
// A tile of nr (1 .. 16) rows in AMX's tiles, summed as 1, 2, 4, 8, 12 or 16 (the tiles are
// configured for nr rows: the rows past it are zero).
template <bool kSigned>
inline void amx_tile_rows(const Activations& a, const RowScales& rs, int64_t r0, int nr,
                          const Panel& p, int64_t nu, const int32_t* order, float* out) {
  AmxProducts<kSigned> products(&a.q[r0 * a.k], a.k, nr, p, nu, order);
  const float* dx = &rs.d[r0 * nu];
  const float* sx = kSigned ? nullptr : &rs.sum32[r0 * nu];
  const auto run = [&](auto rows) {
    panel_rows<decltype(rows)::value, kSigned>(dx, sx, nr, p, nu, products, out);
  };
  if (nr <= 1) return run(std::integral_constant<int, 1>());
  if (nr <= 2) return run(std::integral_constant<int, 2>());
  if (nr <= 4) return run(std::integral_constant<int, 4>());
  if (nr <= 8) return run(std::integral_constant<int, 8>());
  if (nr <= 12) return run(std::integral_constant<int, 12>());
  return run(std::integral_constant<int, 16>());
}
#endif

// A panel's 16 weight rows into L2, fetched while the panel before it runs: its rows (and
// their scale planes) are 16 streams at once, more than the hardware prefetchers follow.
inline void prefetch_panel(const uint8_t* w, int64_t row_bytes) {
  for (int j = 0; j < 16; ++j)
    for (int64_t at = 0; at < row_bytes; at += 64)
      _mm_prefetch(reinterpret_cast<const char*>(w + j * row_bytes + at), _MM_HINT_T1);
}

// y[:, o0 .. o1) of rows activation rows (o1 - o0 a multiple of 16) for one weight of format
// F (the 32-weight formats planar; the K-quants in either layout), the activations' scales
// from `step`; `amx`: AMX's tiles make the products (the process may use them), else VNNI.
template <typename F, typename T>
void int8_panels_linear(const Activations& a, int64_t rows, StepScales& step,
                        const uint8_t* w, int64_t row_bytes, bool planar, bool amx,
                        const T* bias, int64_t o0, int64_t o1, T* y, int64_t ld) {
  using U = Units<F>;
  const int64_t nb = a.k / F::kBlock, nu = a.k / U::kWidth;
  const RowScales& scales = step.of(U::kWidth);
  at::parallel_for(o0 / 16, o1 / 16, 1, [&](int64_t p0, int64_t p1) {
    [[maybe_unused]] int configured = 0;  // the activation rows AMX's tiles are shaped for
    Panel panel(nu, U::kWidth);
    const std::vector<int32_t> order = amx ? lane_order(nu) : std::vector<int32_t>();
    Field f[16][F::kFields];
    std::vector<float> out(16 * 16);
    for (int64_t p = p0; p < p1; ++p) {
      if (p + 1 < p1) prefetch_panel(w + 16 * (p + 1) * row_bytes, row_bytes);
      for (int j = 0; j < 16; ++j) fields<F>(w + (16 * p + j) * row_bytes, nb, planar, f[j]);
      panel.unpack<F>(f, nb);
      for (int64_t r0 = 0; r0 < rows; r0 += 16) {
        const int nr = static_cast<int>(std::min<int64_t>(16, rows - r0));
#ifdef TIDAL_GGUF_AMX
        if (amx && nr != configured) {
          const TileConfig config(configured = nr, U::kWidth);
          _tile_loadconfig(&config);
        }
        if (amx)
          amx_tile_rows<U::kSigned>(a, scales, r0, nr, panel, nu, order.data(), out.data());
        else
#endif
          vnni_tile_rows<U::kWidth, U::kSigned>(a, scales, r0, nr, panel, nu, out.data());
        const __m512 b = bias != nullptr ? load16(bias + 16 * p) : _mm512_setzero_ps();
        for (int r = 0; r < nr; ++r) {  // as dot_rows: 0 + the sum, then the bias
          const __m512 sum = _mm512_add_ps(_mm512_setzero_ps(), _mm512_loadu_ps(&out[16 * r]));
          store16(y + (r0 + r) * ld + 16 * p, _mm512_add_ps(sum, b));
        }
      }
    }
#ifdef TIDAL_GGUF_AMX
    if (configured) _tile_release();
#endif
  });
}

}  // namespace gguf
}  // namespace tidal_cpu
#else
namespace tidal_cpu {
namespace gguf {
class StepScales {  // no int8 panels in this build: nothing to keep
 public:
  StepScales(const Activations&, int64_t) {}
};
}  // namespace gguf
}  // namespace tidal_cpu
#endif
