// Activation rows rounded to int8 for the GGUF integer kernels, per group of 32 values as
// ggml's Q8_0: a scale per group, the exact sum of its x (the 32-weight formats' mins) and,
// for the K-quants, the sums of each 16 of q and each scale repeated over 8 lanes.

#pragma once

#include "gguf_formats.h"
#include "tidal_cpu.h"

#include <vector>

namespace tidal_cpu {
namespace gguf {

struct Activations {
  int64_t k = 0;                // values per row
  std::vector<int8_t> q;        // [rows, k]
  std::vector<float> d;         // [rows * k / 32]: q * d is x rounded
  std::vector<float> sum;       // the exact sum of each group's x
  std::vector<int16_t> sum16;   // with k_quants: the sum of each 16 of q
  std::vector<float> d8;        // with k_quants: each d 8 times

  // x as the kernels see it: value i of row-major [rows, k].
  float value(int64_t i) const { return d[i / kGroup] * static_cast<float>(q[i]); }
};

// rows x k values (k a multiple of 32) rounded to int8 with one scale per 32.
template <typename T>
Activations quantize(const T* x, int64_t rows, int64_t k, bool k_quants) {
  constexpr int64_t group = kGroup;
  const int64_t groups = rows * k / group;
  Activations a;
  a.k = k;
  a.q.resize(rows * k);
  a.d.resize(groups);
  a.sum.resize(groups);
  if (k_quants) a.sum16.resize(groups * 2), a.d8.resize(groups * 8);
  at::parallel_for(0, groups, 64, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      const T* v = x + g * group;
      float amax = 0.f, sum = 0.f;
      for (int64_t i = 0; i < group; ++i) {
        amax = std::max(amax, std::abs(f32(v[i])));
        sum += f32(v[i]);
      }
      const float d = amax / 127.f, inv = d > 0.f ? 1.f / d : 0.f;
      int8_t* q = &a.q[g * group];
      for (int64_t i = 0; i < group; ++i)
        q[i] = static_cast<int8_t>(std::nearbyint(f32(v[i]) * inv));
      a.d[g] = d;
      a.sum[g] = sum;
      if (!k_quants) continue;
      std::fill_n(&a.d8[g * 8], 8, d);
      for (int64_t s = 0; s < 2; ++s) {
        int32_t t = 0;
        for (int i = 0; i < 16; ++i) t += q[16 * s + i];
        a.sum16[g * 2 + s] = static_cast<int16_t>(t);
      }
    }
  });
  return a;
}

}  // namespace gguf
}  // namespace tidal_cpu
