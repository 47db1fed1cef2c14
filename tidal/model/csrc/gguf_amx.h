// GGUF formats through AMX int8 tiles, for 16 weight rows at a time: each unit of a row's
// weights (a 32-weight block; a K-quant's sub-block of 32, or Q6_K's of 16) unpacked as bytes
// and transposed into a tile in AMX's 4-byte-interleaved layout, then one TDPBSUD (TDPBSSD
// for Q6_K's signed q - 32) per unit and 16 activation rows gives 16 x 16 integer dot
// products, each scaled by its unit's d (and offset times the rounded x's sum) as the VNNI
// kernels scale them, unit u in lane u % 16, the lanes summed in _mm512_reduce_add_ps's order.
// The 32-weight formats (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, planar) take gguf_dot32.h's unsigned
// bytes: where a row holds whole rounds of 16 blocks (in_features a multiple of 512) every
// output equals dot32's bit for bit. dot32 sums its last nb % 16 blocks in partial sums of 4
// weights (cheaper for a few blocks than whole ones); here each is one sum, so such rows
// differ from dot32's in float32 rounding alone. The K-quants (Q4_K, Q5_K, Q6_K, in the
// file's layout) scale each sub-block's sum in float, where gguf_kdot.h sums a block's
// sub-blocks in integers first: the same products, apart by float32 rounding alone.

#pragma once

#include "gguf_panel.h"

#ifdef TIDAL_GGUF_DOT32
#if defined(__AMX_TILE__) && defined(__AMX_INT8__)
#define TIDAL_GGUF_AMX 1
#include <sys/syscall.h>
#include <unistd.h>

#include <type_traits>
#include <vector>

namespace tidal_cpu {
namespace gguf {

// Whether this process may use the tiles: Linux hands AMX's 8 KB of tile state only to a
// process that asks (ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA); a refusal keeps the VNNI
// kernels.
inline bool amx_allowed() {
  static const bool allowed = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return allowed;
}

// The tiles' shapes, as LDTILECFG reads them: tile t of rows[t] rows of colsb[t] bytes.
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
  TileConfig() = default;
  // Tiles 0-2: C (sums), A (activation rows) and B (weights), shaped for `n` activation rows
  // and units of `width` weights.
  TileConfig(int n, int width) {
    shape(0, n, 64);
    shape(1, n, width);
    shape(2, width / 4, 64);
  }
  void shape(int t, int n, int bytes) {
    rows[t] = static_cast<uint8_t>(n);
    colsb[t] = static_cast<uint16_t>(bytes);
  }
};


// Lane l's units (l, l + 16, l + 32, ...) one after another: dot32 sums block b in lane b % 16,
// so taking a lane's units together keeps its accumulators in registers, in dot32's order.
inline std::vector<int32_t> lane_order(int64_t nu) {
  std::vector<int32_t> order;
  for (int l = 0; l < 16; ++l)
    for (int64_t u = l; u < nu; u += 16) order.push_back(static_cast<int32_t>(u));
  return order;
}

// The activations' scales d and sums sum32 by tile of 16 rows and unit of `width` weights:
// [tile][unit][16], read a row at a time as broadcasts; a last tile's missing rows are 0, and
// units of 16 (signed, without offsets) need no sums.
struct RowScales {
  std::vector<float> d, sum32;
  RowScales(const Activations& a, int64_t rows, int width) {
    const int64_t ng = a.k / kGroup, nu = a.k / width, tiles = (rows + 15) / 16;
    d.assign(tiles * nu * 16, 0.f);
    sum32.assign(width == kGroup ? tiles * nu * 16 : 0, 0.f);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t u = 0; u < nu; ++u) {
        const int64_t at = ((r / 16) * nu + u) * 16 + r % 16, g = r * ng + u * width / kGroup;
        d[at] = a.d[g];
        if (width == kGroup) sum32[at] = a.sum32[g];
      }
  }
};

// rows r0 .. r0 + nr against a panel of nu units: out[r] (16 floats, the panel's rows).
// The tiles are configured for nr rows; NR >= nr rows are summed in registers (those past nr
// have zero scales and are not stored). A unit's tile product is issued kAhead units
// before the float work that reads its sums, so that the tile store has landed by then.
template <int NR, bool kSigned>
inline void amx_rows(const Activations& a, const RowScales& rs, int64_t r0, int nr,
                     const Panel& p, int64_t nu, const int32_t* order, float* out) {
  constexpr int kAhead = 2;
  alignas(64) int32_t c[kAhead + 1][16][16];
  alignas(64) float acc[16][NR][16];  // [lane][row][weight row], dot32's accumulators
  if (nr < 16) std::memset(c, 0, sizeof(c));  // the rows the tiles leave unwritten
  const int64_t k = a.k, width = p.width;
  const float* dx = &rs.d[r0 * nu];  // [unit][16 rows]
  const float* sx = kSigned ? nullptr : &rs.sum32[r0 * nu];
  const int8_t* x = &a.q[r0 * k];
  const auto issue = [&](int64_t i) {
    const int64_t u = order[i];
    _tile_loadd(2, &p.tiles[u * width * 16], 64);
    _tile_zero(0);
    _tile_loadd(1, x + u * width, k);
    if constexpr (kSigned) _tile_dpbssd(0, 1, 2);
    else _tile_dpbsud(0, 1, 2);
    _tile_stored(0, c[i % (kAhead + 1)], 64);
  };
  for (int64_t i = 0; i < std::min<int64_t>(kAhead, nu); ++i) issue(i);
  int64_t i = 0;
  for (int l = 0; l < 16; ++l) {
    __m512 s[NR];
    for (int r = 0; r < NR; ++r) s[r] = _mm512_setzero_ps();
    for (int64_t u = l; u < nu; u += 16, ++i) {
      if (i + kAhead < nu) issue(i + kAhead);
      const int32_t(*sums)[16] = c[i % (kAhead + 1)];
      const __m512 d = _mm512_loadu_ps(&p.d[u * 16]), off = _mm512_loadu_ps(&p.off[u * 16]);
      for (int r = 0; r < NR; ++r) {
        const __m512 sum = _mm512_cvtepi32_ps(_mm512_load_si512(sums[r]));
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

// A tile of nr (1 .. 16) rows, summed as 1, 2, 4, 8, 12 or 16.
template <bool kSigned>
inline void amx_tile_rows(const Activations& a, const RowScales& rs, int64_t r0, int nr,
                          const Panel& p, int64_t nu, const int32_t* order, float* out) {
  if (nr <= 1) return amx_rows<1, kSigned>(a, rs, r0, nr, p, nu, order, out);
  if (nr <= 2) return amx_rows<2, kSigned>(a, rs, r0, nr, p, nu, order, out);
  if (nr <= 4) return amx_rows<4, kSigned>(a, rs, r0, nr, p, nu, order, out);
  if (nr <= 8) return amx_rows<8, kSigned>(a, rs, r0, nr, p, nu, order, out);
  if (nr <= 12) return amx_rows<12, kSigned>(a, rs, r0, nr, p, nu, order, out);
  return amx_rows<16, kSigned>(a, rs, r0, nr, p, nu, order, out);
}


// A panel's 16 weight rows into L2, fetched while the panel before it runs: its rows (and
// their scale planes) are 16 streams at once, more than the hardware prefetchers follow.
inline void prefetch_panel(const uint8_t* w, int64_t row_bytes) {
  for (int j = 0; j < 16; ++j)
    for (int64_t at = 0; at < row_bytes; at += 64)
      _mm_prefetch(reinterpret_cast<const char*>(w + j * row_bytes + at), _MM_HINT_T1);
}

// y[:, o0 .. o1) of rows activation rows (o1 - o0 a multiple of 16) for one weight of format
// F (the 32-weight formats planar; the K-quants in either layout).
template <typename F, typename T>
void amx_linear(const Activations& a, int64_t rows, const uint8_t* w, int64_t row_bytes,
                bool planar, const T* bias, int64_t o0, int64_t o1, T* y, int64_t ld) {
  using U = Units<F>;
  const int64_t nb = a.k / F::kBlock, nu = a.k / U::kWidth;
  const RowScales scales(a, rows, U::kWidth);
  at::parallel_for(o0 / 16, o1 / 16, 1, [&](int64_t p0, int64_t p1) {
    int configured = 0;  // the activation rows the tiles are shaped for
    Panel panel(nu, U::kWidth);
    const std::vector<int32_t> order = lane_order(nu);
    Field f[16][F::kFields];
    std::vector<float> out(16 * 16);
    for (int64_t p = p0; p < p1; ++p) {
      if (p + 1 < p1) prefetch_panel(w + 16 * (p + 1) * row_bytes, row_bytes);
      for (int j = 0; j < 16; ++j) fields<F>(w + (16 * p + j) * row_bytes, nb, planar, f[j]);
      panel.unpack<F>(f, nb);
      for (int64_t r0 = 0; r0 < rows; r0 += 16) {
        const int nr = static_cast<int>(std::min<int64_t>(16, rows - r0));
        if (nr != configured) {
          const TileConfig config(configured = nr, U::kWidth);
          _tile_loadconfig(&config);
        }
        amx_tile_rows<U::kSigned>(a, scales, r0, nr, panel, nu, order.data(), out.data());
        const __m512 b = bias != nullptr ? load16(bias + 16 * p) : _mm512_setzero_ps();
        for (int r = 0; r < nr; ++r) {  // as dot_rows: 0 + the sum, then the bias
          const __m512 sum = _mm512_add_ps(_mm512_setzero_ps(), _mm512_loadu_ps(&out[16 * r]));
          store16(y + (r0 + r) * ld + 16 * p, _mm512_add_ps(sum, b));
        }
      }
    }
    _tile_release();
  });
}

}  // namespace gguf
}  // namespace tidal_cpu
#endif
#endif
