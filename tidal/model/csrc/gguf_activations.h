// Activation rows rounded to int8 for the GGUF integer kernels, a scale per group of 32
// values (ggml's Q8_0 grid), each scale an integer multiple r of one base per 8 groups
// (256 values): d = r * base, r in 1..kSteps, base = amax(256) / (127 * kSteps). A group's
// d is then at most 1 + 1/r above its own amax / 127, so the rounding is per 32 for every
// group that matters, while a K-quant block's sums stay integers to its end (its scales
// times r, as int16) and cost one float multiply-add per block (gguf_kdot.h), as ggml's
// coarser Q8_K grid (one scale per 256) does.

#pragma once

#include "gguf_formats.h"
#include "tidal_cpu.h"

#include <type_traits>
#include <vector>

namespace tidal_cpu {
namespace gguf {

constexpr int kSteps = 128;  // r's range: a K-quant scale times r stays in int16

struct Activations {
  int64_t k = 0;                // values per row
  std::vector<int8_t> q;        // [rows, k]
  std::vector<float> d;         // [rows * k / 32]: q * d is x rounded
  std::vector<float> sum32;     // the sum of each group's q, times d: x's sum as rounded
  std::vector<int16_t> r;       // each group's d / base
  std::vector<float> base;      // per row, per 8 groups (the last ones of a row: fewer)
  std::vector<float> sum16;     // with k_quants: the sum of each 16 of q, times d
  std::vector<int8_t> qi;       // with runs of n groups: q, each n groups of a row as 8 x n x 4
                                // (dword i of group l at 4 n i + 4 l; gguf_dot32.h, _dot8.h)
  std::vector<int8_t> kx;       // with k_lanes: q, each 256 values' dword 4 i + t at 16 t + i

  int64_t bases_per_row() const { return (k / kGroup + 7) / 8; }
};

// The element types the vector paths load (others, e.g. double, take the scalar loops).
template <typename T>
constexpr bool kVectorLoads = std::is_same_v<T, float> || std::is_same_v<T, BFloat16>;

#ifdef TIDAL_GGUF_AVX2
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const BFloat16* p) {  // bf16 is the top half of a float's bits
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline int32_t hsum_epi32(__m256i v) {
  const __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  const __m128i t = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(1, 0, 3, 2)));
  return _mm_cvtsi128_si32(_mm_add_epi32(t, _mm_shuffle_epi32(t, _MM_SHUFFLE(2, 3, 0, 1))));
}
#endif

// The largest |x| of a group of 32.
template <typename T>
inline float group_amax(const T* v) {
#ifdef TIDAL_GGUF_AVX2
  if constexpr (kVectorLoads<T>) {
    const __m256 sign = _mm256_set1_ps(-0.f);
    __m256 m = _mm256_andnot_ps(sign, load8(v));
    for (int c = 1; c < 4; ++c) m = _mm256_max_ps(m, _mm256_andnot_ps(sign, load8(v + 8 * c)));
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
  }
#endif
  float m = 0.f;
  for (int64_t i = 0; i < kGroup; ++i) m = std::max(m, std::abs(f32(v[i])));
  return m;
}

// q = x * inv rounded to nearest even, clamped to +-127; sums: those of q's two halves.
// Both paths round alike (cvtps2dq uses the default rounding mode, as nearbyint does).
template <typename T>
inline void round_group(const T* v, float inv, int8_t* q, int32_t* sums) {
#ifdef TIDAL_GGUF_AVX2
  if constexpr (kVectorLoads<T>) {
    const __m256 iv = _mm256_set1_ps(inv), lo = _mm256_set1_ps(-127.f), hi = _mm256_set1_ps(127.f);
    __m256i i[4];
    for (int c = 0; c < 4; ++c)
      i[c] = _mm256_cvtps_epi32(
          _mm256_min_ps(_mm256_max_ps(_mm256_mul_ps(load8(v + 8 * c), iv), lo), hi));
    // packs work within 128-bit lanes: [0-3 of i0, i1, i2, i3 | 4-7 of each], then reordered
    const __m256i b =
        _mm256_packs_epi16(_mm256_packs_epi32(i[0], i[1]), _mm256_packs_epi32(i[2], i[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q),
                        _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    sums[0] = hsum_epi32(_mm256_add_epi32(i[0], i[1]));
    sums[1] = hsum_epi32(_mm256_add_epi32(i[2], i[3]));
    return;
  }
#endif
  sums[0] = sums[1] = 0;
  for (int64_t i = 0; i < kGroup; ++i) {
    q[i] = static_cast<int8_t>(std::clamp(std::nearbyint(f32(v[i]) * inv), -127.f, 127.f));
    sums[i / 16] += q[i];
  }
}

// rows x k values (k a multiple of 32) rounded to int8 as above (and one group past the end
// readable); k_quants: with sum16; run > 0: with qi, interleaved in runs of `run` groups;
// k_lanes (k a multiple of 256): with kx (gguf_kdot_vnni.h).
template <typename T>
Activations quantize(const T* x, int64_t rows, int64_t k, bool k_quants, int run,
                     bool k_lanes = false) {
  const int64_t per_row = k / kGroup, groups = rows * per_row;
  Activations a;
  a.k = k;
  a.q.resize(rows * k + kGroup);
  a.d.resize(groups + 8);
  a.sum32.resize(groups + 8);
  a.r.resize(groups);
  a.base.resize(rows * a.bases_per_row());
  if (k_quants) a.sum16.resize(groups * 2);
  at::parallel_for(0, static_cast<int64_t>(a.base.size()), 16, [&](int64_t s0, int64_t s1) {
    for (int64_t s = s0; s < s1; ++s) {
      const int64_t row = s / a.bases_per_row(), first = (s % a.bases_per_row()) * 8;
      const int64_t g0 = row * per_row + first, n = std::min<int64_t>(8, per_row - first);
      float amax[8] = {}, top = 0.f;
      for (int64_t j = 0; j < n; ++j) {
        amax[j] = group_amax(x + (g0 + j) * kGroup);
        top = std::max(top, amax[j]);
      }
      const float base = top / (127.f * kSteps);
      a.base[s] = base;
      for (int64_t j = 0; j < n; ++j) {
        const int64_t g = g0 + j;
        const float steps = top > 0.f ? std::ceil(amax[j] * kSteps / top) : 1.f;
        const int r = std::clamp(static_cast<int>(steps), 1, kSteps);
        const float d = static_cast<float>(r) * base, inv = d > 0.f ? 1.f / d : 0.f;
        a.r[g] = static_cast<int16_t>(r);
        a.d[g] = d;
        int32_t sums[2];
        round_group(x + g * kGroup, inv, &a.q[g * kGroup], sums);
        if (k_quants)
          for (int h = 0; h < 2; ++h) a.sum16[g * 2 + h] = static_cast<float>(sums[h]) * d;
        a.sum32[g] = static_cast<float>(sums[0] + sums[1]) * d;
      }
    }
  });
  if (run > 0) {
    a.qi.resize(a.q.size());
    const int64_t runs = per_row / run;  // whole runs a row
    at::parallel_for(0, rows * runs, 16, [&](int64_t s0, int64_t s1) {
      for (int64_t s = s0; s < s1; ++s) {
        const int64_t at = ((s / runs) * per_row + (s % runs) * run) * kGroup;
        for (int64_t i = 0; i < 8; ++i)
          for (int64_t l = 0; l < run; ++l)
            std::memcpy(&a.qi[at + 4 * run * i + 4 * l], &a.q[at + kGroup * l + 4 * i], 4);
      }
    });
  }
  if (k_lanes) {
    a.kx.resize(a.q.size());
    at::parallel_for(0, groups / 8, 64, [&](int64_t s0, int64_t s1) {
      for (int64_t s = s0; s < s1; ++s) {
        const int8_t* q = &a.q[s * 256];
        for (int t = 0; t < 4; ++t)
          for (int i = 0; i < 16; ++i)
            std::memcpy(&a.kx[s * 256 + 64 * t + 4 * i], q + 16 * i + 4 * t, 4);
      }
    });
  }
  return a;
}

}  // namespace gguf
}  // namespace tidal_cpu
