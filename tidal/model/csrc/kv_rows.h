// The KV cache's rows (one token's one KV head): `d` values of the model's dtype, or, with
// --kv-cache-dtype int8 / fp8_e4m3, d one-byte codes followed by the row's scale as a float16
// count of 2^-8 units (tidal/model/kv_quant.py, whose writes these equal bit for bit), or bf16
// values under a float32 model, rounded to nearest even as c10::BFloat16 (and torch) round
// them.

#pragma once

#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Half.h>

#include "tidal_cpu.h"

namespace tidal_cpu {

using F8 = c10::Float8_e4m3fn;

// Whether cache element type C is a quantized row's code (else the model's dtype itself).
template <typename C>
constexpr bool kCoded = std::is_same_v<C, int8_t> || std::is_same_v<C, F8>;

// A coded row's scale: float16, counting steps of 1 / kScaleSteps (float16's normal range
// moved down to K's and V's), saturating at float16's largest finite value.
constexpr int64_t kScaleBytes = 2;
constexpr float kScaleSteps = 256.f, kScaleMax = 65504.f;

// Elements of one row in the cache: the codes and the scale's 2 bytes.
template <typename C>
constexpr int64_t row_width(int64_t d) { return kCoded<C> ? d + kScaleBytes : d; }

// The row's scale (1 for rows of the model's dtype).
template <typename C>
inline float row_scale(const C* row, int64_t d) {
  if constexpr (!kCoded<C>) {
    return 1.f;
  } else {
    c10::Half s;
    std::memcpy(&s, row + d, sizeof s);
    return static_cast<float>(s) / kScaleSteps;  // exact: a power of two
  }
}

// The codes' largest magnitude: x ~= code * scale, scale = max|x| / kCodeMax.
template <typename C>
constexpr float kCodeMax = std::is_same_v<C, int8_t> ? 127.f : 448.f;

// Refuses slots (int64, contiguous) other than one a row of `rows`, or a slot outside the
// cache's num_slots rows (or below `lowest`: -1 lets padding through), before anything is
// written: write_kv writes by raw offset.
inline void check_slots(const Tensor& slots, int64_t rows, int64_t num_slots, int64_t lowest) {
  TORCH_CHECK_VALUE(slots.numel() == rows, "one slot a token");
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < slots.numel(); ++t)
    TORCH_CHECK_VALUE(slot[t] >= lowest && slot[t] < num_slots, "slot ", slot[t],
                      " is not in the cache");
}

// Writes the `hkv` heads of `d` values at `offset` of each qkv row to that row's slot
// (a negative slot, padding: nothing): copied, or coded as kv_quant.py codes them (x / scale
// in float32, clamped, then rounded half to even or to e4m3 by c10).
template <typename T, typename C>
void write_kv(const T* qkv, int64_t row_stride, int64_t offset, const int64_t* slots,
              int64_t rows, int64_t hkv, int64_t d, C* cache) {
  const int64_t w = row_width<C>(d);
  for (int64_t r = 0; r < rows; ++r) {
    if (slots[r] < 0) continue;
    const T* src = qkv + r * row_stride + offset;
    C* dst = cache + slots[r] * hkv * w;
    if constexpr (!kCoded<C>) {
      std::copy_n(src, hkv * d, dst);
    } else {
      for (int64_t h = 0; h < hkv; ++h, src += d, dst += w) {
        float amax = 0.f;
        for (int64_t i = 0; i < d; ++i) amax = std::max(amax, std::abs(f32(src[i])));
        const c10::Half stored(std::min(amax / kCodeMax<C> * kScaleSteps, kScaleMax));
        const float scale = static_cast<float>(stored) / kScaleSteps;
        const float div = scale > 0.f ? scale : 1.f;
        for (int64_t i = 0; i < d; ++i) {
          const float v = std::min(kCodeMax<C>, std::max(-kCodeMax<C>, f32(src[i]) / div));
          if constexpr (std::is_same_v<C, int8_t>)
            dst[i] = static_cast<int8_t>(std::nearbyint(v));
          else
            dst[i] = F8(v);
        }
        std::memcpy(dst + d, &stored, sizeof stored);
      }
    }
  }
}

// Whether a cache of dtype `s` holds quantized rows.
inline bool coded(at::ScalarType s) { return s == at::kChar || s == at::kFloat8_e4m3fn; }

// Calls f.template operator()<C>() with C the element type of a cache of dtype `s` whose
// model computes in T: the codes' type where quantized, BFloat16 for a bf16 cache under a
// float32 model (--kv-cache-dtype bfloat16), else T.
template <typename T, typename F>
auto with_cache_type(at::ScalarType s, F&& f) {
  if constexpr (!std::is_same_v<T, BFloat16>)
    if (s == at::kBFloat16) return f.template operator()<BFloat16>();
  if (!coded(s)) return f.template operator()<T>();
  if (s == at::kChar) return f.template operator()<int8_t>();
  return f.template operator()<F8>();
}

}  // namespace tidal_cpu
