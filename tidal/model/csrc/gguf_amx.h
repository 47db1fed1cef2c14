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

// Tiles 0-2 for 16 activation rows (C, A, B), 3-4 for a last tile of `rest` rows (C, A).
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
  explicit TileConfig(int rest) {
    const int shape[5][2] = {{16, 64}, {16, 32}, {8, 64}, {rest, 64}, {rest, 32}};
    for (int t = 0; t < 5; ++t) {
      rows[t] = static_cast<uint8_t>(shape[t][0]);
      colsb[t] = static_cast<uint16_t>(shape[t][0] ? shape[t][1] : 0);
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

// rows r0 .. r0 + nr against a panel: out[r] (16 floats, the panel's rows) = dot32's sums.
// 16 rows take tiles 0 and 1 (C, A), fewer (`Last`) tiles 3 and 4, shaped for them.
template <bool Last>
inline void amx_rows(const Activations& a, int64_t r0, int nr, const Panel& p, int64_t nb,
                     float* out) {
  alignas(64) int32_t c[16][16];
  alignas(64) float acc[16][16][16];  // [lane][row][weight row], dot32's accumulators
  for (int l = 0; l < 16; ++l)
    for (int r = 0; r < nr; ++r) _mm512_store_ps(acc[l][r], _mm512_setzero_ps());
  const int64_t k = a.k;
  for (int64_t b = 0; b < nb; ++b) {
    const int8_t* x = &a.q[r0 * k + b * kGroup];
    _tile_loadd(2, &p.tiles[b * 512], 64);
    if constexpr (Last) {  // the tile intrinsics take their tile's number as a literal
      _tile_zero(3);
      _tile_loadd(4, x, k);
      _tile_dpbsud(3, 4, 2);
      _tile_stored(3, c, 64);
    } else {
      _tile_zero(0);
      _tile_loadd(1, x, k);
      _tile_dpbsud(0, 1, 2);
      _tile_stored(0, c, 64);
    }
    const __m512 d = _mm512_loadu_ps(&p.d[b * 16]), off = _mm512_loadu_ps(&p.off[b * 16]);
    float(*lane)[16] = acc[b % 16];
    for (int r = 0; r < nr; ++r) {
      const int64_t g = (r0 + r) * nb + b;
      const __m512 sum = _mm512_cvtepi32_ps(_mm512_load_si512(c[r]));
      _mm512_store_ps(lane[r], _mm512_fmadd_ps(sum, _mm512_mul_ps(d, _mm512_set1_ps(a.d[g])),
                                               _mm512_fmadd_ps(off, _mm512_set1_ps(a.sum32[g]),
                                                               _mm512_load_ps(lane[r]))));
    }
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

// y[:, o0 .. o1) of rows activation rows (o1 - o0 a multiple of 16) for one planar weight.
template <typename F, typename T>
void amx_linear(const Activations& a, int64_t rows, const uint8_t* w, int64_t row_bytes,
                const T* bias, int64_t o0, int64_t o1, T* y, int64_t ld) {
  const int64_t nb = a.k / kGroup;
  at::parallel_for(o0 / 16, o1 / 16, 1, [&](int64_t p0, int64_t p1) {
    const TileConfig config(static_cast<int>(rows % 16));
    _tile_loadconfig(&config);
    Panel panel(nb);
    Field f[16][F::kFields];
    std::vector<float> out(16 * 16);
    for (int64_t p = p0; p < p1; ++p) {
      for (int j = 0; j < 16; ++j) fields<F>(w + (16 * p + j) * row_bytes, nb, true, f[j]);
      panel.unpack<F>(f, nb);
      for (int64_t r0 = 0; r0 < rows; r0 += 16) {
        const int nr = static_cast<int>(std::min<int64_t>(16, rows - r0));
        if (nr == 16) amx_rows<false>(a, r0, nr, panel, nb, out.data());
        else amx_rows<true>(a, r0, nr, panel, nb, out.data());
        for (int r = 0; r < nr; ++r)
          for (int j = 0; j < 16; ++j) {
            const int64_t o = 16 * p + j;
            float v = 0.f;
            v += out[16 * r + j];  // as dot_rows: 0 + the sum, then the bias
            y[(r0 + r) * ld + o] = round_to<T>(v + (bias != nullptr ? f32(bias[o]) : 0.f));
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
