// Decode scores over int8 KV rows in integers: each query head rounded to int16 (a scale a
// head), each key's codes multiplied with it and summed exactly in int32, then
// float(sum) x the head's scale x the key's row scale. The sums are exact, so every path
// (vector or scalar, any instruction set, any lane count) gives a score the same bits, and a
// token costs about half the operations of widening its codes to floats. q's rounding (half
// of 2^-15 of its largest element) lies far below the codes' own (half of 2^-7 of theirs).

#pragma once

#include "kv_vectors.h"

#include <array>
#include <cmath>
#include <type_traits>
#include <vector>

namespace tidal_cpu {

// 2 kLanes int16 lanes (a pair of products into each of kLanes int32 lanes): VPMADDWD, or
// VPDPWSSD with AVX512-VNNI; elsewhere the compiler's lane by lane.
#ifdef __AVX512BW__
typedef __m512i vi16;
inline vi16 widen16(const int8_t* p) {
  return _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline vi32 dot_pairs(vi32 acc, vi16 a, vi16 b) {
#ifdef __AVX512VNNI__
  return reinterpret_cast<vi32>(_mm512_dpwssd_epi32(reinterpret_cast<__m512i>(acc), a, b));
#else
  return acc + reinterpret_cast<vi32>(_mm512_madd_epi16(a, b));
#endif
}
#elif defined(__AVX2__) && !defined(__AVX512F__)
typedef __m256i vi16;
inline vi16 widen16(const int8_t* p) {
  return _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline vi32 dot_pairs(vi32 acc, vi16 a, vi16 b) {
  return acc + reinterpret_cast<vi32>(_mm256_madd_epi16(a, b));
}
#else
typedef int16_t vi16 __attribute__((vector_size(4 * kLanes)));
inline vi16 widen16(const int8_t* p) {
  typedef int8_t codes __attribute__((vector_size(2 * kLanes)));
  codes b;
  std::memcpy(&b, p, sizeof b);
  return __builtin_convertvector(b, vi16);
}
inline vi32 dot_pairs(vi32 acc, vi16 a, vi16 b) {
  for (int i = 0; i < kLanes; ++i) acc[i] += a[2 * i] * b[2 * i] + a[2 * i + 1] * b[2 * i + 1];
  return acc;
}
#endif

// q's `groups` heads of d values as int16 codes, q ~= scale x code: each head's largest
// magnitude at 32767, the rest rounded to nearest (even on ties).
inline void round_queries(const float* qf, int64_t groups, int64_t d, int16_t* codes,
                          float* scales) {
  for (int64_t j = 0; j < groups; ++j) {
    const float* x = qf + j * d;
    float top = 0.f;
    for (int64_t i = 0; i < d; ++i) top = std::max(top, std::abs(x[i]));
    scales[j] = top > 0.f ? top / 32767.f : 1.f;
    for (int64_t i = 0; i < d; ++i)
      codes[j * d + i] = static_cast<int16_t>(std::nearbyint(x[i] / scales[j]));
  }
}

// Every key's scores, an element at a time (where d is not a multiple of 2 kLanes): scores
// of query head j at scores[j n + t].
inline void int8_scores_each(const float* qf, const int8_t* k_cache, const Paged& ctx,
                             int64_t n, int64_t groups, int64_t d, float* scores) {
  std::vector<int16_t> codes(groups * d);
  std::vector<float> scale(groups);
  round_queries(qf, groups, d, codes.data(), scale.data());
  ctx.each(n, [&](int64_t t, int64_t off) {
    const int8_t* key = k_cache + off;
    const float s = row_scale(key, d);
    for (int64_t j = 0; j < groups; ++j) {
      int32_t sum = 0;
      for (int64_t i = 0; i < d; ++i) sum += codes[j * d + i] * key[i];
      scores[j * n + t] = static_cast<float>(sum) * scale[j] * s;
    }
  });
}

// A value in place (N > 0, so that the compiler can keep it in registers) or on the heap.
template <typename V, int N>
using Slots = std::conditional_t<(N > 0), std::array<V, (N > 0 ? N : 1)>, std::vector<V>>;

// The scores of a KV head's query heads against runs of kLanes keys, for d = 2 kLanes x NK
// (NK and G known at compile time, or 0: read from d and groups). `add` takes one key of
// the run; `scores` writes the run's m keys' scores, each query head's `stride` apart.
template <int NK, int G>
struct Int8Scores {
  int64_t nk, groups;
  Slots<vi16, G * NK> q;
  Slots<float, G> scale;
  Slots<vi32, G * kLanes> part;  // [query head][key of the run]: its products, by lane
  float key_scale[kLanes];

  Int8Scores(const float* qf, int64_t groups_, int64_t d)
      : nk(NK > 0 ? NK : d / (2 * kLanes)), groups(G > 0 ? G : groups_) {
    if constexpr (G * NK == 0) {
      q.resize(groups * nk), scale.resize(groups), part.resize(groups * kLanes);
    }
    std::vector<int16_t> codes(groups * d);
    round_queries(qf, groups, d, codes.data(), scale.data());
    std::memcpy(q.data(), codes.data(), sizeof(int16_t) * codes.size());
  }
  void add(const int8_t* row, int m) {
    const int64_t n = NK > 0 ? NK : nk;
    vi16 k[kMaxHeadDim / (2 * kLanes)];
    for (int64_t c = 0; c < n; ++c) k[c] = widen16(row + 2 * kLanes * c);
    key_scale[m] = row_scale(row, 2 * kLanes * n);
    for (int64_t j = 0; j < (G > 0 ? G : groups); ++j) {
      vi32 sum = dot_pairs(vi32{}, q[j * n], k[0]);
      for (int64_t c = 1; c < n; ++c) sum = dot_pairs(sum, q[j * n + c], k[c]);
      part[j * kLanes + m] = sum;
    }
  }
  void scores(int m, float* out, int64_t stride) {
    std::fill(key_scale + m, key_scale + kLanes, 0.f);
    for (int64_t j = 0; j < (G > 0 ? G : groups); ++j) {
      vi32* pj = &part[j * kLanes];
      std::fill(pj + m, pj + kLanes, vi32{});
      const vf s = __builtin_convertvector(transpose_sum(pj), vf) * scale[j] * loadv(key_scale);
      std::memcpy(out + j * stride, &s, sizeof(float) * m);
    }
  }
};

}  // namespace tidal_cpu
