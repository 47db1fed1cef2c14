// The 32-weight formats (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1), planar, through AMX int8 tiles: for
// 16 weight rows at a time, each block's 16 x 32 unsigned bytes (gguf_dot32.h's Unsigned32)
// transposed into a tile in AMX's 4-byte-interleaved layout, then one TDPBSUD per block and
// 16 activation rows gives the 16 x 16 integer dot products that dot32 sums with VNNI. Each is
// scaled by the float operations dot32 applies to it, block b in lane b % 16, and the lanes
// are summed in _mm512_reduce_add_ps's order: where a row holds whole rounds of 16 blocks
// (in_features a multiple of 512) every output equals dot32's bit for bit. dot32 sums its
// last nb % 16 blocks in partial sums of 4 weights (cheaper for a few blocks than whole ones);
// here each is one sum, so such rows differ from dot32's in float32 rounding alone.

#pragma once

#include "gguf_dot32.h"

#ifdef TIDAL_GGUF_DOT32
#if defined(__AMX_TILE__) && defined(__AMX_INT8__)
#define TIDAL_GGUF_AMX 1
#include <sys/syscall.h>
#include <unistd.h>

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

// Tiles 0-2: C (sums), A (activation rows) and B (weights), shaped for `n` activation rows.
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
  explicit TileConfig(int n) {
    const int shape[3][2] = {{n, 64}, {n, 32}, {8, 64}};
    for (int t = 0; t < 3; ++t) {
      rows[t] = static_cast<uint8_t>(shape[t][0]);
      colsb[t] = static_cast<uint16_t>(shape[t][1]);
    }
  }
};

// One panel of 16 weight rows, unpacked once a step for every activation tile: block b's
// tile (8 rows of 16 x 4 bytes), its 16 scales d and offsets m - c d (dot32's).
struct Panel {
  std::vector<uint8_t> tiles;  // [nb][8][64]
  std::vector<float> d, off;   // [nb][16]
  explicit Panel(int64_t nb) : tiles(nb * 512), d(nb * 16), off(nb * 16) {}

  template <typename F>
  void unpack(const Field (*f)[F::kFields], int64_t nb) {
    using U = Unsigned32<F>;
    alignas(64) uint16_t h[2][16];
    for (int64_t b = 0; b < nb; ++b) {
      __m512i rows[8];  // rows 2t and 2t + 1's block b, side by side
      for (int t = 0; t < 8; ++t)
        rows[t] = _mm512_inserti64x4(U::pair(f[2 * t], b, false),
                                     _mm512_castsi512_si256(U::pair(f[2 * t + 1], b, false)), 1);
      __m512i tile[8];  // row i, lane j: weights 4i .. 4i + 3 of weight row j
      transpose16(rows, tile);
      for (int i = 0; i < 8; ++i) _mm512_storeu_si512(&tiles[b * 512 + 64 * i], tile[i]);
      for (int j = 0; j < 16; ++j)
        for (int field = 0; field < (F::kMin ? 2 : 1); ++field)
          std::memcpy(&h[field][j], f[j][field].at(b), 2);
      const auto halves = [&](int field) {  // the 16 rows' float16 field as floats
        return _mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(h[field])));
      };
      const __m512 dj = halves(0), mj = F::kMin ? halves(1) : _mm512_setzero_ps();
      _mm512_storeu_ps(&d[b * 16], dj);
      _mm512_storeu_ps(&off[b * 16], _mm512_fnmadd_ps(_mm512_set1_ps(U::kCentre), dj, mj));
    }
  }
};

// Lane l's blocks (l, l + 16, l + 32, ...) one after another: dot32 sums block b in lane b % 16,
// so taking a lane's blocks together keeps its accumulators in registers, in dot32's order.
inline std::vector<int32_t> lane_order(int64_t nb) {
  std::vector<int32_t> order;
  for (int l = 0; l < 16; ++l)
    for (int64_t b = l; b < nb; b += 16) order.push_back(static_cast<int32_t>(b));
  return order;
}

// The activations' scales d and sums sum32 by tile of 16 rows and block: [tile][block][16],
// read a row at a time as broadcasts; a last tile's missing rows are 0.
struct RowScales {
  std::vector<float> d, sum32;
  RowScales(const Activations& a, int64_t rows) {
    const int64_t nb = a.k / kGroup, tiles = (rows + 15) / 16;
    d.assign(tiles * nb * 16, 0.f);
    sum32.assign(tiles * nb * 16, 0.f);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t b = 0; b < nb; ++b) {
        const int64_t at = ((r / 16) * nb + b) * 16 + r % 16;
        d[at] = a.d[r * nb + b];
        sum32[at] = a.sum32[r * nb + b];
      }
  }
};

// rows r0 .. r0 + nr against a panel: out[r] (16 floats, the panel's rows) = dot32's sums.
// The tiles are configured for nr rows; NR >= nr rows are summed in registers (those past nr
// have zero scales and are not stored). A block's tile product is issued kAhead blocks
// before the float work that reads its sums, so that the tile store has landed by then.
template <int NR>
inline void amx_rows(const Activations& a, const RowScales& rs, int64_t r0, int nr,
                     const Panel& p, int64_t nb, const int32_t* order, float* out) {
  constexpr int kAhead = 2;
  alignas(64) int32_t c[kAhead + 1][16][16];
  alignas(64) float acc[16][NR][16];  // [lane][row][weight row], dot32's accumulators
  if (nr < 16) std::memset(c, 0, sizeof(c));  // the rows the tiles leave unwritten
  const int64_t k = a.k;
  const float* dx = &rs.d[r0 * nb];  // [block][16 rows]
  const float* sx = &rs.sum32[r0 * nb];
  const int8_t* x = &a.q[r0 * k];
  const auto issue = [&](int64_t i) {
    const int64_t b = order[i];
    _tile_loadd(2, &p.tiles[b * 512], 64);
    _tile_zero(0);
    _tile_loadd(1, x + b * kGroup, k);
    _tile_dpbsud(0, 1, 2);
    _tile_stored(0, c[i % (kAhead + 1)], 64);
  };
  for (int64_t i = 0; i < std::min<int64_t>(kAhead, nb); ++i) issue(i);
  int64_t i = 0;
  for (int l = 0; l < 16; ++l) {
    __m512 s[NR];
    for (int r = 0; r < NR; ++r) s[r] = _mm512_setzero_ps();
    for (int64_t b = l; b < nb; b += 16, ++i) {
      if (i + kAhead < nb) issue(i + kAhead);
      const int32_t(*sums)[16] = c[i % (kAhead + 1)];
      const __m512 d = _mm512_loadu_ps(&p.d[b * 16]), off = _mm512_loadu_ps(&p.off[b * 16]);
      for (int r = 0; r < NR; ++r) {
        const __m512 sum = _mm512_cvtepi32_ps(_mm512_load_si512(sums[r]));
        s[r] = _mm512_fmadd_ps(sum, _mm512_mul_ps(d, _mm512_set1_ps(dx[16 * b + r])),
                               _mm512_fmadd_ps(off, _mm512_set1_ps(sx[16 * b + r]), s[r]));
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

// A last tile of nr (1 .. 15) rows, summed as 1, 2, 4, 8, 12 or 16.
inline void amx_last_rows(const Activations& a, const RowScales& rs, int64_t r0, int nr,
                          const Panel& p, int64_t nb, const int32_t* order, float* out) {
  if (nr <= 1) return amx_rows<1>(a, rs, r0, nr, p, nb, order, out);
  if (nr <= 2) return amx_rows<2>(a, rs, r0, nr, p, nb, order, out);
  if (nr <= 4) return amx_rows<4>(a, rs, r0, nr, p, nb, order, out);
  if (nr <= 8) return amx_rows<8>(a, rs, r0, nr, p, nb, order, out);
  if (nr <= 12) return amx_rows<12>(a, rs, r0, nr, p, nb, order, out);
  return amx_rows<16>(a, rs, r0, nr, p, nb, order, out);
}

// 16 values of T as floats, and back as round_to rounds them.
template <typename T>
inline __m512 load16(const T* p) {
  alignas(64) float v[16];
  for (int j = 0; j < 16; ++j) v[j] = f32(p[j]);
  return _mm512_load_ps(v);
}
template <typename T>
inline void store16(T* p, __m512 v) {
  alignas(64) float f[16];
  _mm512_store_ps(f, v);
  for (int j = 0; j < 16; ++j) p[j] = round_to<T>(f[j]);
}
template <>
inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }

// A panel's 16 weight rows into L2, fetched while the panel before it runs: its rows (and
// their scale planes) are 16 streams at once, more than the hardware prefetchers follow.
inline void prefetch_panel(const uint8_t* w, int64_t row_bytes) {
  for (int j = 0; j < 16; ++j)
    for (int64_t at = 0; at < row_bytes; at += 64)
      _mm_prefetch(reinterpret_cast<const char*>(w + j * row_bytes + at), _MM_HINT_T1);
}

// y[:, o0 .. o1) of rows activation rows (o1 - o0 a multiple of 16) for one planar weight.
template <typename F, typename T>
void amx_linear(const Activations& a, int64_t rows, const uint8_t* w, int64_t row_bytes,
                const T* bias, int64_t o0, int64_t o1, T* y, int64_t ld) {
  const int64_t nb = a.k / kGroup;
  const RowScales scales(a, rows);
  at::parallel_for(o0 / 16, o1 / 16, 1, [&](int64_t p0, int64_t p1) {
    int configured = 0;  // the activation rows the tiles are shaped for
    Panel panel(nb);
    const std::vector<int32_t> order = lane_order(nb);
    Field f[16][F::kFields];
    std::vector<float> out(16 * 16);
    for (int64_t p = p0; p < p1; ++p) {
      if (p + 1 < p1) prefetch_panel(w + 16 * (p + 1) * row_bytes, row_bytes);
      for (int j = 0; j < 16; ++j) fields<F>(w + (16 * p + j) * row_bytes, nb, true, f[j]);
      panel.unpack<F>(f, nb);
      for (int64_t r0 = 0; r0 < rows; r0 += 16) {
        const int nr = static_cast<int>(std::min<int64_t>(16, rows - r0));
        if (nr != configured) {
          const TileConfig config(configured = nr);
          _tile_loadconfig(&config);
        }
        if (nr == 16) amx_rows<16>(a, scales, r0, nr, panel, nb, order.data(), out.data());
        else amx_last_rows(a, scales, r0, nr, panel, nb, order.data(), out.data());
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
