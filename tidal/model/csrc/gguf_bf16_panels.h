// GGUF weights multiplied in bf16 a panel at a time, for steps of many rows: each panel of
// 16 weight rows is unpacked once (gguf_panel.h: its units' bytes, scales d and offsets), its
// weights d q + offset rounded to bf16 as `dequantize` rounds them and laid out in pairs of
// k, then multiplied by x in bf16 with the products summed in float32 over all of k and
// rounded to bf16: in AMX's TDPBF16PS tiles where the process may use AMX, else by
// AVX512-BF16's VDPBF16PS (Zen 4). No float work a block and row (the int8 kernels' cost),
// and no dequantized copy of the weight in memory (the oneDNN tiles' cost: each step wrote
// and read again the whole model in bf16): the products are the dequantized tiles' up to
// float32 rounding of the sums.

#pragma once

#include "tidal_cpu.h"
#include "gguf_amx.h"
#include "gguf_panel.h"

#if defined(TIDAL_GGUF_DOT32) && defined(__AVX512BF16__)
#define TIDAL_GGUF_BF16_PANELS 1
#if defined(TIDAL_GGUF_AMX) && defined(__AMX_BF16__)
#define TIDAL_GGUF_AMX_BF16 1
#endif

namespace tidal_cpu {
namespace gguf {

// A panel's 16 weight rows in bf16, a pair of k at a time: rows[p], lane j: weights 2p and
// 2p + 1 of weight row j (VDPBF16PS's operand; for AMX rows[16t .. 16t + 15] is B tile t).
struct Bf16Panel {
  __m512i* rows;  // [k / 2], in a thread's scratch (group_scratch)

  // The weights of an unpacked panel of nu units: unit u's tile row i holds weights 4i ..
  // 4i + 3 of each weight row as bytes (kSigned: signed, no offset), each d q + offset.
  template <bool kSigned>
  void from(const Panel& p, int64_t nu) {
    alignas(64) static const int16_t kInterleave[32] = {
        0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
        8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
    const __m512i interleave = _mm512_load_si512(kInterleave);
    const int n = p.width / 4;  // a unit's tile rows
    for (int64_t u = 0; u < nu; ++u) {
      const __m512 d = _mm512_loadu_ps(&p.d[u * 16]), off = _mm512_loadu_ps(&p.off[u * 16]);
      __m512i* out = &rows[u * 2 * n];
      for (int i = 0; i < n; ++i) {
        const __m512i v = _mm512_loadu_si512(&p.tiles[(u * n + i) * 64]);
        __m512 w[4];
        for (int b = 0; b < 4; ++b) {
          const __m512i q =
              kSigned ? _mm512_srai_epi32(_mm512_slli_epi32(v, 24 - 8 * b), 24)
                      : _mm512_and_si512(_mm512_srli_epi32(v, 8 * b), _mm512_set1_epi32(255));
          w[b] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(q), d, off);
        }
        // cvtne2ps gives [w0's 16 | w1's 16] in bf16; the permute pairs lane j's two
        out[2 * i] = _mm512_permutexvar_epi16(interleave, (__m512i)_mm512_cvtne2ps_pbh(w[1], w[0]));
        out[2 * i + 1] =
            _mm512_permutexvar_epi16(interleave, (__m512i)_mm512_cvtne2ps_pbh(w[3], w[2]));
      }
    }
  }
};

#ifdef TIDAL_GGUF_AMX_BF16
// M (1 or 2) tiles of 16 rows of x (bf16, row stride k) against two panels: c[m][j] = the
// sums of x's tile m and panel j. Each tile of x is loaded once for both panels and each
// tile of weights once for both tiles of x: half the loads of one product at a time.
template <int M>
inline void bf16_2x2(const uint16_t* x, int64_t k, const Bf16Panel& w0, const Bf16Panel& w1,
                     float (*c)[2][16][16]) {
  const int64_t stride = 2 * k;
  _tile_zero(0);
  _tile_zero(1);
  if constexpr (M > 1) {
    _tile_zero(2);
    _tile_zero(3);
  }
  const int64_t nt = k / 32;
  for (int64_t t = 0; t < nt; ++t) {  // GCC's tile intrinsics take literal register numbers
    _tile_loadd(4, x + 32 * t, stride);
    _tile_loadd(6, &w0.rows[16 * t], 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_loadd(7, &w1.rows[16 * t], 64);
    _tile_dpbf16ps(1, 4, 7);
    if constexpr (M > 1) {
      _tile_loadd(5, x + 16 * k + 32 * t, stride);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, c[0][0], 64);
  _tile_stored(1, c[0][1], 64);
  if constexpr (M > 1) {
    _tile_stored(2, c[1][0], 64);
    _tile_stored(3, c[1][1], 64);
  }
}
#endif

// The bytes of bf16 weight tiles a thread keeps at once (a group of panels), for L2.
constexpr int64_t kBf16GroupBytes = 1 << 19;

// A thread's room for at least n vectors of bf16 weight tiles, kept from call to call: a
// group allocated afresh each call came back from the allocator as new pages to fault in
// (7% of a prompt burst's time).
inline __m512i* group_scratch(int64_t n) {
  thread_local std::vector<__m512i> scratch;
  if (static_cast<int64_t>(scratch.size()) < n) scratch.resize(n);
  return scratch.data();
}

// v rounded to bf16, as float32: the tiles' products in bf16, as oneDNN's bf16 GEMMs give
// them, so an output in float32 holds the very values one in bf16 does.
inline __m512 as_bf16(__m512 v) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(bf16_bits(v), 16));
}

#ifdef TIDAL_GGUF_AMX_BF16
// All rows of x (bf16, row stride k, padded to whole tiles of 16) against a group's ng
// panels (panel i's pairs at w + i k / 2) in AMX tiles, two by two: the pair of x's tiles
// stays in L1 across the group, the weights stream from L2.
template <typename T>
void amx_group(const uint16_t* x, int64_t rows, int64_t k, __m512i* w, int64_t ng, T* y,
               int64_t ld) {
  const auto weights = [&](int64_t i) { return Bf16Panel{w + i * k / 2}; };
  alignas(64) float c[2][2][16][16];
  const int64_t tiles = (rows + 15) / 16;
  for (int64_t t0 = 0; t0 < tiles; t0 += 2) {
    const uint16_t* xt = x + 16 * t0 * k;
    for (int64_t i0 = 0; i0 < ng; i0 += 2) {
      const int np = static_cast<int>(std::min<int64_t>(2, ng - i0));
      // a lone last panel is multiplied twice: its second products are not stored
      const Bf16Panel w0 = weights(i0), w1 = weights(i0 + np - 1);
      if (tiles - t0 > 1) bf16_2x2<2>(xt, k, w0, w1, c);
      else bf16_2x2<1>(xt, k, w0, w1, c);
      for (int64_t r = 16 * t0; r < std::min(rows, 16 * (t0 + 2)); ++r)
        for (int i = 0; i < np; ++i) {
          const __m512 sum = _mm512_load_ps(c[(r / 16) - t0][i][r % 16]);
          store16(y + r * ld + 16 * (i0 + i), std::is_same_v<T, float> ? as_bf16(sum) : sum);
        }
    }
  }
}
#endif

// NR rows of x (bf16, row stride k) by NP panels (panel j's pairs at w + j k / 2) over all of
// k, the NR x NP sums in registers: each weight vector loaded serves NR rows, each broadcast
// pair of x NP panels.
template <int NR, int NP, typename T>
inline void dp_block(const uint16_t* x, int64_t k, const __m512i* w, T* y, int64_t ld) {
  const int64_t pairs = k / 2;
  __m512 acc[NR][NP];
  for (int r = 0; r < NR; ++r)
    for (int j = 0; j < NP; ++j) acc[r][j] = _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p) {
    __m512bh wv[NP];
    for (int j = 0; j < NP; ++j) wv[j] = (__m512bh)_mm512_load_si512(&w[j * pairs + p]);
    for (int r = 0; r < NR; ++r) {
      int32_t pair;  // row r's x 2p and 2p + 1
      std::memcpy(&pair, x + r * k + 2 * p, 4);
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);
      for (int j = 0; j < NP; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], xb, wv[j]);
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int j = 0; j < NP; ++j)
      store16(y + r * ld + 16 * j, std::is_same_v<T, float> ? as_bf16(acc[r][j]) : acc[r][j]);
}

// NR rows of x by a group's ng panels: 4 panels at a time, NR x 4 sums in registers.
template <int NR, typename T>
void dp_rows(const uint16_t* x, int64_t k, const __m512i* w, int64_t ng, T* y, int64_t ld) {
  int64_t i = 0;
  for (; i + 4 <= ng; i += 4) dp_block<NR, 4>(x, k, w + i * k / 2, y + 16 * i, ld);
  const __m512i* wi = w + i * k / 2;
  if (ng - i == 3) dp_block<NR, 3>(x, k, wi, y + 16 * i, ld);
  else if (ng - i == 2) dp_block<NR, 2>(x, k, wi, y + 16 * i, ld);
  else if (ng - i == 1) dp_block<NR, 1>(x, k, wi, y + 16 * i, ld);
}

// All rows of x against a group's ng panels by VDPBF16PS: 6 rows at a time (24 of the 32
// vector registers hold sums), the group's weights streaming from L2 for each.
template <typename T>
void dp_group(const uint16_t* x, int64_t rows, int64_t k, const __m512i* w, int64_t ng, T* y,
              int64_t ld) {
  constexpr int kRows = 6;
  int64_t r = 0;
  for (; r + kRows <= rows; r += kRows) dp_rows<kRows>(x + r * k, k, w, ng, y + r * ld, ld);
  const uint16_t* xr = x + r * k;
  T* yr = y + r * ld;
  switch (rows - r) {
    case 5: return dp_rows<5>(xr, k, w, ng, yr, ld);
    case 4: return dp_rows<4>(xr, k, w, ng, yr, ld);
    case 3: return dp_rows<3>(xr, k, w, ng, yr, ld);
    case 2: return dp_rows<2>(xr, k, w, ng, yr, ld);
    case 1: return dp_rows<1>(xr, k, w, ng, yr, ld);
    default: return;
  }
}

// y[:, o0 .. o1) (o1 - o0 a multiple of 16) of `rows` rows of x ([rows rounded up to 16, k]
// bf16, the rows past `rows` any values) for one weight of format F (the 32-weight formats
// planar; the K-quants in either layout); `amx`: in AMX tiles (else VDPBF16PS).
template <typename F, typename T>
void panels_linear(const uint16_t* x, int64_t rows, int64_t k, const uint8_t* w,
                   int64_t row_bytes, bool planar, bool amx, int64_t o0, int64_t o1, T* y,
                   int64_t ld) {
  using U = Units<F>;
  const int64_t nb = k / F::kBlock, nu = k / U::kWidth;
  const int64_t first = o0 / 16, panels = (o1 - o0) / 16;
  // groups of panels whose bf16 weights stay in L2, each multiplied by all of x's rows
  const int64_t group = std::max<int64_t>(2, kBf16GroupBytes / (32 * k) / 2 * 2);
  at::parallel_for(0, (panels + 1) / 2, 1, [&](int64_t q0, int64_t q1) {
#ifdef TIDAL_GGUF_AMX_BF16
    if (amx) {
      TileConfig config;  // 0-3: sums (x's tile, panel); 4, 5: x's rows; 6, 7: weights
      for (int t = 0; t < 8; ++t) config.shape(t, 16, 64);
      _tile_loadconfig(&config);
    }
#endif
    Panel panel(nu, U::kWidth);
    __m512i* scratch = group_scratch(std::min(group, 2 * (q1 - q0)) * k / 2);
    Field f[16][F::kFields];
    for (int64_t g0 = first + 2 * q0; g0 < std::min(first + panels, first + 2 * q1);
         g0 += group) {
      const int64_t ng = std::min({group, first + panels - g0, first + 2 * q1 - g0});
      for (int64_t i = 0; i < ng; ++i) {
        for (int j = 0; j < 16; ++j)
          fields<F>(w + (16 * (g0 + i) + j) * row_bytes, nb, planar, f[j]);
        panel.unpack<F>(f, nb);
        Bf16Panel{scratch + i * k / 2}.template from<U::kSigned>(panel, nu);
      }
#ifdef TIDAL_GGUF_AMX_BF16
      if (amx) {
        amx_group(x, rows, k, scratch, ng, y + 16 * g0, ld);
        continue;
      }
#endif
      dp_group(x, rows, k, scratch, ng, y + 16 * g0, ld);
    }
#ifdef TIDAL_GGUF_AMX_BF16
    if (amx) _tile_release();
#endif
  });
}

// The bytes of x (bf16) a pass over a weight's panels takes: each group of panels reads them
// again, from L2 up to about this.
constexpr int64_t kBf16TileBytes = 3 << 19;

// Whether the bf16 panels take rows x: in one pass, or in passes of at least 128 rows
// (in_features up to 6,144). Passes of fewer unpack each panel for too few rows: on AMX at
// 1,024 rows of 8,192 in_features (passes of 96) oneDNN's GEMMs over dequantized tiles ran
// ~10% faster, of 16,384 1.6x; of 2,048-5,632 the tiles ran 1.1-1.35x faster.
inline bool bf16_panels_take(const at::Tensor& x, const GGUFProjection& g) {
  return g.bf16_panels &&
         (2 * x.numel() <= kBf16TileBytes || 2 * 128 * g.in_features <= kBf16TileBytes);
}

// y = xs W^T through the bf16 panels, every part in whole panels, in passes of rows whose x
// stays in L2; xs: bf16, its rows padded to a multiple of 16 (the rows past y's any values).
inline void bf16_panels(const at::Tensor& xs, const GGUFProjection& g, at::Tensor& y) {
  TORCH_CHECK(xs.is_contiguous() && xs.size(0) % 16 == 0 && xs.size(0) >= y.size(0));
  const int64_t k = g.in_features, rows = y.size(0), ld = y.size(1);
  const int64_t pass = std::max<int64_t>(16, kBf16TileBytes / (2 * k) / 16 * 16);
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(xs.data_ptr<at::BFloat16>());
#ifdef TIDAL_GGUF_AMX_BF16
  const bool amx = g.amx;  // AMX granted, and not turned off for this projection
#else
  const bool amx = false;
#endif
  for (int64_t r0 = 0; r0 < rows; r0 += pass) {
    const int64_t n = std::min(pass, rows - r0);
    int64_t col = 0;
    for (const GGUFPart& p : g.parts) {
      with_format(p.type, [&](auto format) {
        using F = decltype(format);
        const auto run = [&](auto* out) {
          panels_linear<F>(xp + r0 * k, n, k, p.data.data_ptr<uint8_t>(), p.data.size(1),
                           p.planar, amx, 0, p.data.size(0), out + r0 * ld + col, ld);
        };
        if (y.scalar_type() == at::kFloat) run(y.data_ptr<float>());
        else run(y.data_ptr<at::BFloat16>());
      });
      col += p.data.size(0);
    }
  }
}
}  // namespace gguf
}  // namespace tidal_cpu
#endif

#ifndef TIDAL_GGUF_BF16_PANELS
namespace tidal_cpu {
namespace gguf {
inline bool bf16_panels_take(const at::Tensor&, const GGUFProjection&) { return false; }
}  // namespace gguf
}  // namespace tidal_cpu
#endif
