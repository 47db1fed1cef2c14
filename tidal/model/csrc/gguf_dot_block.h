// The 32-weight formats one block a step, where neither gguf_dot32.h nor gguf_dot8.h
// takes them (GGUF's own layout; Q8_0 without AVX-512 VNNI; scalar code without AVX2):
// (q - c) . x in integers, then one float multiply-add for the scale and one for the min,
// m + c * s (see kCenter), times x's sum.

#pragma once

#include "gguf_activations.h"
#include "gguf_formats.h"

namespace tidal_cpu {
namespace gguf {

#ifdef TIDAL_GGUF_AVX2
// Sums of 4 adjacent u8 x s8 products as int32 lanes (lane i: weights 4i..4i+3).
TIDAL_INLINE __m256i dot_u8s8(__m256i u, __m256i s) {
#if defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s);
#elif defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#else
  // pairs to int16 cannot saturate: |q| <= 128 and |a| <= 127
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}
#endif

#ifdef TIDAL_GGUF_AVX2
template <typename F, int NR>
TIDAL_INLINE void dot_avx2(const Activations& a, int64_t r0, const Field* f,
                           const Prefetch& pf, int64_t nb, float* out) {
  static_assert(F::kBlock == kGroup);
  float s[1][2], m[1];
  __m256 acc[NR];
  for (int r = 0; r < NR; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    pf.block(b);
    F::scales(f, b, s, m);
    __m256i q = F::vec(f, b, 0);
    if (F::kCenter) q = _mm256_sub_epi8(q, _mm256_set1_epi8(F::kCenter));
    const __m256i u = _mm256_abs_epi8(q);  // u8 x s8 products: the sign moves onto x
    const __m256 sv = _mm256_set1_ps(s[0][0]);
    for (int r = 0; r < NR; ++r) {
      const int64_t rg = (r0 + r) * nb + b;
      const __m256i x8 = _mm256_sign_epi8(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(&a.q[rg * kGroup])), q);
      const __m256 p = _mm256_cvtepi32_ps(dot_u8s8(u, x8));
      acc[r] = _mm256_fmadd_ps(p, _mm256_mul_ps(sv, _mm256_set1_ps(a.d[rg])), acc[r]);
      if (F::kMin) out[r] += (m[0] + F::kCenter * s[0][0]) * a.sum32[rg];
    }
  }
  for (int r = 0; r < NR; ++r) out[r] += hsum(acc[r]);
}
#else
template <typename F, int NR>
TIDAL_INLINE void dot_scalar(const Activations& a, int64_t r0, const Field* f,
                             const Prefetch& pf, int64_t nb, float* out) {
  static_assert(F::kBlock == kGroup);
  float s[1][2], m[1];
  int8_t q[kGroup];
  for (int64_t b = 0; b < nb; ++b) {
    pf.block(b);
    F::scales(f, b, s, m);
    F::scalar(f, b, 0, q);
    for (int r = 0; r < NR; ++r) {
      const int64_t rg = (r0 + r) * nb + b;
      const int8_t* x8 = &a.q[rg * kGroup];
      int32_t dot = 0;
      for (int i = 0; i < kGroup; ++i) dot += (q[i] - F::kCenter) * x8[i];
      out[r] += a.d[rg] * s[0][0] * dot + (m[0] + F::kCenter * s[0][0]) * a.sum32[rg];
    }
  }
}
#endif

}  // namespace gguf
}  // namespace tidal_cpu
