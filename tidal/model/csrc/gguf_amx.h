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

#include "gguf_dot32.h"
#include "gguf_kdot.h"

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

// How format F's weights enter the tiles: units of kWidth weights, each with one scale d per
// weight row, unsigned bytes with an offset (the 32-weight formats, Q4_K, Q5_K: the mins)
// or, kSigned, signed ones without (Q6_K).
template <typename F>
struct Units {
  static constexpr bool kSigned = std::is_same_v<F, Q6_K>;
  static constexpr int kWidth = kSigned ? 16 : 32;
};

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

// One panel of 16 weight rows, unpacked once a step for every activation tile: unit u's
// tile (width / 4 rows of 16 x 4 bytes), its 16 scales d and offsets.
struct Panel {
  int width;
  std::vector<uint8_t> tiles;  // [units][width / 4][64]
  std::vector<float> d, off;   // [units][16]
  Panel(int64_t units, int width_)
      : width(width_), tiles(units * width_ * 16), d(units * 16), off(units * 16) {}

  // A panel row's nb blocks of format F: the 32-weight formats' as dot32's unsigned bytes and
  // offsets m - c d, the K-quants' sub-blocks as F::vec gives them (unpack_k).
  template <typename F>
  void unpack(const Field (*f)[F::kFields], int64_t nb) {
    if constexpr (F::kBlock != kGroup) {
      unpack_k<F>(f, nb);
    } else {
      using U = Unsigned32<F>;
      alignas(64) uint16_t h[2][16];
      for (int64_t b = 0; b < nb; ++b) {
        __m512i rows[8];  // rows 2t and 2t + 1's block b, side by side
        for (int t = 0; t < 8; ++t)
          rows[t] = _mm512_inserti64x4(U::pair(f[2 * t], b, false),
                                       _mm512_castsi512_si256(U::pair(f[2 * t + 1], b, false)), 1);
        store_tile(rows, b);
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
  }

 private:
  // A tile of 32 weights (two of 16: the first 4 rows, then the next 4) at unit group g.
  void store(const __m512i* tile, int64_t g) {
    for (int i = 0; i < 8; ++i) _mm512_storeu_si512(&tiles[g * 512 + 64 * i], tile[i]);
  }
  // 16 rows' 32 weights (rows 2t and 2t + 1 in rows[t]) as the tile at unit group g: row i,
  // lane j: weights 4i .. 4i + 3 of weight row j.
  void store_tile(const __m512i* rows, int64_t g) {
    __m512i tile[8];
    transpose16(rows, tile);
    store(tile, g);
  }

  // K-quant blocks: each 32 bytes of the 16 rows' quants transposed once, every sub-block's
  // tile cut from them by bytewise shifts and masks (which commute with the transposition):
  // the bits F::vec (gguf_formats.h) takes of one row, here of 16 at once.
  template <typename F>
  void unpack_k(const Field (*f)[F::kFields], int64_t nb) {
    __m512i tile[8];
    for (int64_t b = 0; b < nb; ++b) {
      k_scales<F>(f, b);
      if constexpr (std::is_same_v<F, Q6_K>) {  // group 4h + t: ql chunk 2h + t % 2, qh h
        __m512i ql[4][8], qh[2][8];
        for (int c = 0; c < 4; ++c) transposed<F>(f, 0, b, 32 * c, ql[c]);
        for (int h = 0; h < 2; ++h) transposed<F>(f, 1, b, 32 * h, qh[h]);
        for (int g = 0; g < 8; ++g) {
          const int h = g / 4, t = g % 4;
          for (int i = 0; i < 8; ++i)
            tile[i] = _mm512_sub_epi8(
                _mm512_or_si512(bits(ql[2 * h + t % 2][i], 4 * (t / 2), 15),
                                _mm512_slli_epi16(bits(qh[h][i], 2 * t, 3), 4)),
                _mm512_set1_epi8(32));
          store(tile, b * 8 + g);
        }
      } else {  // groups 2c and 2c + 1: qs chunk c's low and high nibbles; Q5_K: qh bit g
        constexpr bool kFive = F::kFields == 5;
        __m512i qh[8], qs[8];
        if constexpr (kFive) transposed<F>(f, 3, b, 0, qh);
        for (int c = 0; c < 4; ++c) {
          transposed<F>(f, F::kFields - 1, b, 32 * c, qs);
          for (int n = 0; n < 2; ++n) {
            const int g = 2 * c + n;
            for (int i = 0; i < 8; ++i) {
              tile[i] = bits(qs[i], 4 * n, 15);
              if constexpr (kFive)
                tile[i] = _mm512_or_si512(tile[i], _mm512_slli_epi16(bits(qh[i], g, 1), 4));
            }
            store(tile, b * 8 + g);
          }
        }
      }
    }
  }

  // The 32 bytes at `at` of field `field` of the 16 rows' block b, transposed as tiles are.
  template <typename F>
  static void transposed(const Field (*f)[F::kFields], int field, int64_t b, int at,
                         __m512i* out) {
    const auto load = [&](int j) {
      return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(f[j][field].at(b) + at));
    };
    __m512i rows[8];
    for (int t = 0; t < 8; ++t)
      rows[t] = _mm512_inserti64x4(_mm512_castsi256_si512(load(2 * t)), load(2 * t + 1), 1);
    transpose16(rows, out);
  }

  // Each byte's bits from `shift` on, under `mask`.
  static __m512i bits(__m512i v, int shift, int mask) {
    return _mm512_and_si512(_mm512_srl_epi16(v, _mm_cvtsi32_si128(shift)),
                            _mm512_set1_epi8(static_cast<char>(mask)));
  }

  // Block b's unit scales d (d times each sub-block's integer scale, as F::scales computes
  // them) and Q4_K/Q5_K's offsets (-dmin times its min), 16 rows at a time.
  template <typename F>
  void k_scales(const Field (*f)[F::kFields], int64_t b) {
    constexpr bool kQ6 = std::is_same_v<F, Q6_K>;
    constexpr int kUnits = kQ6 ? 16 : 8;  // a block's units
    alignas(64) int8_t sc[kUnits][16];    // [unit][row]: 6-bit or int8 scales
    alignas(64) uint8_t mn[8][16];
    alignas(64) uint16_t h[2][16];        // the rows' float16 d (and dmin)
    for (int j = 0; j < 16; ++j) {
      if constexpr (kQ6) {
        const int8_t* s = reinterpret_cast<const int8_t*>(f[j][2].at(b));
        for (int u = 0; u < kUnits; ++u) sc[u][j] = s[u];
        std::memcpy(&h[0][j], f[j][3].at(b), 2);
      } else {
        uint64_t s8, m8;
        k_scales_mins(f[j][2].at(b), s8, m8);
        for (int u = 0; u < kUnits; ++u) {
          sc[u][j] = static_cast<int8_t>(s8 >> (8 * u));
          mn[u][j] = static_cast<uint8_t>(m8 >> (8 * u));
        }
        std::memcpy(&h[0][j], f[j][0].at(b), 2);
        std::memcpy(&h[1][j], f[j][1].at(b), 2);
      }
    }
    const auto halves = [&](int i) {
      return _mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(h[i])));
    };
    const __m512 dj = halves(0), dmin = kQ6 ? _mm512_setzero_ps() : halves(1);
    for (int u = 0; u < kUnits; ++u) {
      const int64_t at = (b * kUnits + u) * 16;
      const __m128i s = _mm_load_si128(reinterpret_cast<const __m128i*>(sc[u]));
      _mm512_storeu_ps(&d[at], _mm512_mul_ps(dj, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(s))));
      if constexpr (!kQ6) {
        const __m128i m = _mm_load_si128(reinterpret_cast<const __m128i*>(mn[u]));
        _mm512_storeu_ps(&off[at], _mm512_mul_ps(_mm512_sub_ps(_mm512_setzero_ps(), dmin),
                                                 _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(m))));
      }
    }
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
// 16 floats rounded to bf16 as round_to rounds them (to nearest even; NaN as 0x7fc0), as
// the bf16 bits in each lane's low half.
inline __m512i bf16_bits(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i magnitude = _mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff));
  const __mmask16 nan = _mm512_cmpgt_epu32_mask(magnitude, _mm512_set1_epi32(0x7f800000));
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_srli_epi32(
      _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), odd), 16);
  return _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7fc0));
}
template <>
inline void store16(BFloat16* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(bf16_bits(v)));
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
