// A panel of 16 GGUF weight rows unpacked once for many activation rows: each unit of a
// row's weights (a 32-weight block; a K-quant's sub-block of 32, or Q6_K's of 16) as bytes
// transposed 16 rows at a time, with its scale d and offset per row. The int8 panels
// (gguf_int8_panels.h: AMX's tiles or VNNI) multiply those bytes as they lie; the bf16
// panels (gguf_bf16_panels.h) turn them into d q + offset in bf16 first.

#pragma once

#include "gguf_dot32.h"
#include "gguf_kdot.h"

#ifdef TIDAL_GGUF_DOT32
#include <cstring>
#include <type_traits>
#include <vector>

namespace tidal_cpu {
namespace gguf {

// How format F's weights enter a panel: units of kWidth weights, each with one scale d per
// weight row, unsigned bytes with an offset (the 32-weight formats, Q4_K, Q5_K: the mins)
// or, kSigned, signed ones without (Q6_K).
template <typename F>
struct Units {
  static constexpr bool kSigned = std::is_same_v<F, Q6_K>;
  static constexpr int kWidth = kSigned ? 16 : 32;
};

// One panel of 16 weight rows, unpacked once a step for every activation row: unit u's
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

}  // namespace gguf
}  // namespace tidal_cpu
#endif
