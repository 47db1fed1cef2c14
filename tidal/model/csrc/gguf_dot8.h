// The nibble formats (Q4_0, Q4_1, Q5_0, Q5_1), planar, with AVX2 and no AVX-512 VNNI:
// gguf_dot32.h's scheme on 256-bit registers, eight blocks a round. A block's quants as the
// unsigned bytes u = q and y += d_b * dx_b * (u . x) + (m_b - c * d_b) * sum(x_b), c the _0
// formats' centre, the sums those of x as rounded. The quants lie in rounds (kNibbleRounds,
// gguf_formats.h), so a round's four loads unpack into C[i], lane l dword i of block l, once
// for all rows, against x interleaved the same way (Activations::qi, runs of 8 groups).
// maddubs pairs u8 x s8 products into int16 lanes, which a Q4 round sums over all its eight
// steps before widening to int32 (8 * 2 * 15 * 127 < 2^15), Q5 over four: two instructions
// a row for 32 weights of eight blocks. Q8_0 keeps the per-block kernel: its |q| x x pairs
// fill an int16 lane at once.

#pragma once

#include "gguf_activations.h"
#include "gguf_formats.h"

#include <type_traits>

#ifdef TIDAL_GGUF_DOT8  // (gguf_formats.h: AVX2 without AVX-512 VNNI)

namespace tidal_cpu {
namespace gguf {

template <typename F>
struct Nibbles8 {
  static constexpr int kCentre = F::kOffset;
  static constexpr int kSum16 = F::kFiveBits ? 4 : 8;  // steps an int16 lane sums safely
  // Block b's 32 quants as unsigned bytes (one of the last nb % 8, which lie as they are).
  TIDAL_INLINE static __m256i block(const Field* f, int64_t b) {
    const uint8_t* qs = f[F::kFields - 1].at(b);
    const __m256i q = nibbles16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs)));
    if constexpr (F::kFiveBits) return _mm256_or_si256(q, high_bits(u32(f[F::kFields - 2].at(b))));
    else return q;
  }
  // A whole round's quants from block b0: C[i], lane l dword i (weights 4i .. 4i + 3) of
  // block b0 + l. Low nibbles hold weights 0-15, high ones 16-31, so C[i + 4] is C[i]'s
  // bytes' high nibbles; Q5's fifth bits of those weights are bits 4i .. 4i + 3 of qh.
  TIDAL_INLINE static void round(const Field* f, int64_t b0, __m256i* C) {
    const uint8_t* qs = f[F::kFields - 1].dword(b0, 0);
    for (int i = 0; i < 4; ++i) {
      const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * i));
      C[i] = _mm256_and_si256(raw, mask8(15));
      C[i + 4] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), mask8(15));
    }
    if constexpr (F::kFiveBits) {
      const uint8_t* qh = f[F::kFields - 2].at(b0);  // lane l: block b0 + l's fifth bits
      const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qh));
      const __m256i low_byte = _mm256_setr_epi8(0, 0, 0, 0, 4, 4, 4, 4, 8, 8, 8, 8, 12, 12, 12, 12,
                                                0, 0, 0, 0, 4, 4, 4, 4, 8, 8, 8, 8, 12, 12, 12, 12);
      const __m256i bit = _mm256_set1_epi32(0x08040201);  // byte c: bit c
      for (int i = 0; i < 8; ++i) {
        const __m256i spread =
            _mm256_shuffle_epi8(_mm256_srl_epi32(h, _mm_cvtsi32_si128(4 * i)), low_byte);
        C[i] = _mm256_or_si256(C[i], fifth_bits(spread, bit));
      }
    }
  }
};

// Lane l: the sum of v[l]'s eight lanes, the integer a round's lane l holds.
TIDAL_INLINE __m256i reduce8(const __m256i* v) {
  // a: the sums of v[0..3]'s low halves | of their high halves; b: the same for v[4..7]
  const __m256i a = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
  const __m256i b = _mm256_hadd_epi32(_mm256_hadd_epi32(v[4], v[5]), _mm256_hadd_epi32(v[6], v[7]));
  return _mm256_add_epi32(_mm256_permute2x128_si256(a, b, 0x20),
                          _mm256_permute2x128_si256(a, b, 0x31));
}

// One planar row's blocks against NR activation rows; adds each dot product to out[r].
// Whole rounds as above; the last blocks of a row (nb % 8) take x as it lies, a block at a
// time, and sum each block's lanes (reduce8). Either way a block's integer and every float
// operation after it are the same, so a row's result does not depend on the rows beside it
// in the step. No software prefetch: the hardware's keeps up here, and prefetcht2 slowed
// SmolLM2's decode step from 12.9 to 17.6 ms on a 2-core AMD EPYC (Zen 3). Inlined into
// dot_rows (GCC kept it a call through the PLT: 10-25% slower at 1-3 rows).
template <typename F, int NR>
TIDAL_INLINE void dot8(const Activations& a, int64_t r0, const Field* f, int64_t nb, float* out) {
  using U = Nibbles8<F>;
  __m256 acc[NR];
  for (int r = 0; r < NR; ++r) acc[r] = _mm256_setzero_ps();
  const __m256i zero = _mm256_setzero_si256(), ones = _mm256_set1_epi16(1);
  for (int64_t b0 = 0; b0 < nb; b0 += 8) {
    const int n = static_cast<int>(std::min<int64_t>(8, nb - b0));
    // lanes 0 .. n - 1 (a planar field's 16 bytes are readable: the row's quants follow it)
    const __m256 valid = _mm256_castsi256_ps(_mm256_cmpgt_epi32(
        _mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
    const auto halves = [&](int field) {  // the blocks' float16 fields as floats, 0 past n
      const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(f[field].at(b0)));
      return _mm256_and_ps(_mm256_cvtph_ps(h), valid);
    };
    const __m256 d = halves(0);
    const __m256 off = _mm256_fnmadd_ps(_mm256_set1_ps(U::kCentre), d,
                                        F::kMin ? halves(1) : _mm256_setzero_ps());
    // row r's blocks' integers (lane l: block b0 + l) scaled into its accumulator, alike on
    // both paths below (a.d and a.sum32 are readable 8 past the end; d, off are 0 past n)
    const auto scale = [&](int r, int64_t g, __m256i sum) {
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_mul_ps(d, _mm256_loadu_ps(&a.d[g])),
                               _mm256_fmadd_ps(off, _mm256_loadu_ps(&a.sum32[g]), acc[r]));
    };
    if (n == 8) {
      __m256i C[8];
      U::round(f, b0, C);
      for (int r = 0; r < NR; ++r) {
        const int64_t g = (r0 + r) * nb + b0;  // x's groups g .. g + 7, interleaved
        const int8_t* x = &a.qi[g * kGroup];
        __m256i sum = zero, part = zero;
        for (int i = 0; i < 8; ++i) {
          part = _mm256_add_epi16(part, _mm256_maddubs_epi16(C[i], _mm256_loadu_si256(
                                                           reinterpret_cast<const __m256i*>(x + 32 * i))));
          if ((i + 1) % U::kSum16 == 0) {
            sum = _mm256_add_epi32(sum, _mm256_madd_epi16(part, ones));
            part = zero;
          }
        }
        scale(r, g, sum);
      }
    } else {
      __m256i P[8];
      for (int j = 0; j < 8; ++j) P[j] = j < n ? U::block(f, b0 + j) : zero;
      for (int r = 0; r < NR; ++r) {
        const int64_t g = (r0 + r) * nb + b0;  // x's groups g .. g + n - 1 as they lie
        __m256i v[8];
        for (int j = 0; j < 8; ++j)
          v[j] = j < n ? _mm256_madd_epi16(_mm256_maddubs_epi16(P[j], _mm256_loadu_si256(reinterpret_cast<const __m256i*>(
                                                              &a.q[(g + j) * kGroup]))), ones)
                       : zero;
        scale(r, g, reduce8(v));
      }
    }
  }
  for (int r = 0; r < NR; ++r) out[r] += hsum(acc[r]);
}

}  // namespace gguf
}  // namespace tidal_cpu
#endif
