// The 32-weight formats (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1), planar, with AVX-512 VNNI: two
// blocks (64 weights) a step, their quants as unsigned bytes u = q + c (c: 128 for Q8_0's int8, 0 for
// the nibble formats, whose centre 8 or 16 is then part of the offset). Per block b and
// activation row: y += d_b * dx_b * (u . x) + (m_b - c * d_b) * sum(x_b), the products one
// VNNI instruction a step, the sums those of x as rounded.

#pragma once

#include "gguf_activations.h"
#include "gguf_formats.h"

#include <type_traits>

#if defined(TIDAL_GGUF_AVX2) && defined(__AVX512F__) && defined(__AVX512BW__) && \
    defined(__AVX512VNNI__)
#define TIDAL_GGUF_DOT32 1

namespace tidal_cpu {
namespace gguf {

// A planar row's blocks b (low half) and b + 1 (high half; zero unless `both`) of F as
// unsigned bytes, and the centre u carries: u = w / d + kCentre - m / d.
template <typename F>
struct Unsigned32 {
  static constexpr int centre() {
    if constexpr (std::is_same_v<F, Q8_0>) return 128;
    else return F::kOffset;
  }
  static constexpr int kCentre = centre();
  static __m512i pair(const Field* f, int64_t b, bool both) {
    if constexpr (std::is_same_v<F, Q8_0>) {
      const __m512i q = both ? _mm512_loadu_si512(f[1].at(b))
                             : _mm512_zextsi256_si512(_mm256_loadu_si256(
                                   reinterpret_cast<const __m256i*>(f[1].at(b))));
      return _mm512_xor_si512(q, both ? _mm512_set1_epi8(static_cast<char>(0x80))
                                      : _mm512_zextsi256_si512(_mm256_set1_epi8(static_cast<char>(0x80))));
    } else {
      const uint8_t* qs = f[F::kFields - 1].at(b);  // 16 bytes a block, the pair's adjacent
      const __m256i raw = both ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs))
                               : _mm256_zextsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs)));
      const __m256i lo = _mm256_and_si256(raw, _mm256_set1_epi8(15));
      const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), _mm256_set1_epi8(15));
      // [lo b, lo b+1, hi b, hi b+1] -> [lo b, hi b, lo b+1, hi b+1]: each block's 32 weights
      __m512i q = _mm512_shuffle_i64x2(_mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1),
                                       _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1),
                                       _MM_SHUFFLE(3, 1, 2, 0));
      if constexpr (F::kFiveBits) {
        const uint8_t* qh = f[F::kFields - 2].at(b);
        const __m256i h1 = both ? high_bits(u32(qh + 4)) : _mm256_setzero_si256();
        q = _mm512_or_si512(q, _mm512_inserti64x4(_mm512_castsi256_si512(high_bits(u32(qh))), h1, 1));
      }
      return q;
    }
  }
};

// One planar row's blocks against NR activation rows; adds each dot product to out[r]. Eight
// blocks a round: their scales (and mins) converted at once; per row the weights' and x's
// scales multiplied once and spread over each pair's lanes, the offsets one multiply-add.
template <typename F, int NR>
inline void dot32(const Activations& a, int64_t r0, const Field* f, const Prefetch& pf,
                  int64_t nb, float* out) {
  using U = Unsigned32<F>;
  __m512 acc[NR];
  __m256 off_acc[NR];
  for (int r = 0; r < NR; ++r) acc[r] = _mm512_setzero_ps(), off_acc[r] = _mm256_setzero_ps();
  const __m512i zero = _mm512_setzero_si512();
  alignas(64) static const int32_t kPairLanes[4][16] = {
      {0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1}, {2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3},
      {4, 4, 4, 4, 4, 4, 4, 4, 5, 5, 5, 5, 5, 5, 5, 5}, {6, 6, 6, 6, 6, 6, 6, 6, 7, 7, 7, 7, 7, 7, 7, 7}};
  for (int64_t b0 = 0; b0 < nb; b0 += 8) {
    const int n = static_cast<int>(std::min<int64_t>(8, nb - b0));
    const __mmask8 valid = static_cast<__mmask8>((1u << n) - 1);
    const auto halves = [&](int field) {  // n float16 fields of blocks b0.. as floats
      return _mm256_cvtph_ps(_mm_maskz_loadu_epi16(valid, f[field].at(b0)));
    };
    const __m256 d = halves(0);
    // each block's offset m - c d, which multiplies the sum of its x
    const __m256 off = _mm256_fnmadd_ps(_mm256_set1_ps(U::kCentre), d,
                                        F::kMin ? halves(1) : _mm256_setzero_ps());
    __m512i u[4];
    for (int t = 0; 2 * t < n; ++t) {
      pf.block(b0 + 2 * t);
      pf.block(b0 + 2 * t + 1);
      u[t] = U::pair(f, b0 + 2 * t, 2 * t + 1 < n);
    }
    for (int r = 0; r < NR; ++r) {
      const int64_t g = (r0 + r) * nb + b0;  // x's groups g .. g + 7 (readable past the end)
      const __m512 dd = _mm512_zextps256_ps512(_mm256_mul_ps(d, _mm256_maskz_loadu_ps(valid, &a.d[g])));
      off_acc[r] = _mm256_fmadd_ps(off, _mm256_maskz_loadu_ps(valid, &a.sum32[g]), off_acc[r]);
      for (int t = 0; 2 * t < n; ++t) {
        const __m512i i = _mm512_dpbusd_epi32(zero, u[t], _mm512_loadu_si512(&a.q[(g + 2 * t) * kGroup]));
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i),
                                 _mm512_permutexvar_ps(_mm512_load_si512(kPairLanes[t]), dd), acc[r]);
      }
    }
  }
  for (int r = 0; r < NR; ++r)
    out[r] += _mm512_reduce_add_ps(acc[r]) + _mm512_reduce_add_ps(_mm512_zextps256_ps512(off_acc[r]));
}

}  // namespace gguf
}  // namespace tidal_cpu
#endif
