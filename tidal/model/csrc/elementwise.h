// The loops between projections that the C++ decoder and the fused prompt-path ops share:
// residual add + RMSNorm and RoPE, rounded where the PyTorch path rounds (bf16 after every
// op it rounds at; float32 differs from it only in the RMSNorm sum's order).

#pragma once

#include "tidal_cpu.h"

namespace tidal_cpu {

// h += y, rounded as add_rms_norm rounds its sum.
template <typename T>
void add_into(T* h, const T* y, int64_t n) {
  at::parallel_for(0, n, 1 << 14, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) h[i] = round_to<T>(f32(h[i]) + f32(y[i]));
  });
}

// sum = h + y (rounded like a bf16 add; y null: sum = h), then
// x = weight * T(sum * rsqrt(mean sum^2 + eps)). `sum` may be h itself (in place); y may be
// bf16 under a float32 h (a projection's bf16 products, added as their float32 copy would be).
template <typename T, typename Y = T>
void add_rms_norm(const T* h, const Y* y, T* sum, const T* weight, T* x, int64_t rows,
                  int64_t dim, float eps) {
  at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* hr = h + r * dim;
      T* sr = sum + r * dim;
      if (y != nullptr) {
        const Y* yr = y + r * dim;
        for (int64_t i = 0; i < dim; ++i) sr[i] = round_to<T>(f32(hr[i]) + f32(yr[i]));
      } else if (sr != hr) {
        std::copy_n(hr, dim, sr);
      }
      const float ss = dot(sr, sr, dim);
      const float inv = 1.f / std::sqrt(ss / dim + eps);
      T* xr = x + r * dim;
      for (int64_t i = 0; i < dim; ++i)
        xr[i] = round_to<T>(f32(weight[i]) * f32(round_to<T>(f32(sr[i]) * inv)));
    }
  });
}

// In place on the first `heads` heads of each row: x*cos + rotate_half(x)*sin, the half-split
// pairing of HF checkpoints; the tables hold the signed sine already. Only the first `rd`
// dims of a head rotate (partial rotary); the others pass unchanged.
template <typename T>
void rope(T* qkv, int64_t row_stride, const float* cos, const float* sin, int64_t rows,
          int64_t heads, int64_t d, int64_t rd) {
  const int64_t half = rd / 2;
  at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
    std::vector<float> c(rd), s(rd), x0(rd);
    for (int64_t r = r0; r < r1; ++r) {
      for (int64_t i = 0; i < rd; ++i) {  // the tables are cast to the model's dtype first
        c[i] = f32(round_to<T>(cos[r * rd + i]));
        s[i] = f32(round_to<T>(sin[r * rd + i]));
      }
      for (int64_t hh = 0; hh < heads; ++hh) {
        T* x = qkv + r * row_stride + hh * d;
        for (int64_t i = 0; i < rd; ++i) x0[i] = f32(x[i]);
        auto rot = [&](int64_t i, float rolled) {
          x[i] = round_to<T>(f32(round_to<T>(x0[i] * c[i])) + f32(round_to<T>(rolled * s[i])));
        };
        for (int64_t i = 0; i < half; ++i) rot(i, x0[i + half]);
        for (int64_t i = half; i < rd; ++i) rot(i, x0[i - half]);
      }
    }
  });
}

}  // namespace tidal_cpu
