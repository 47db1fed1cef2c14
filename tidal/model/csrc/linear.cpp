// Projections: oneDNN's linear over packed weights, the int4 (Q4_1 x Q8_1) kernel, Linear.

#include "tidal_cpu.h"

#include <ATen/core/dispatch/Dispatcher.h>

#ifdef __AVX2__
#include <immintrin.h>
#endif

namespace tidal_cpu {
namespace {

// oneDNN's linear over a weight the Python side packed (mkldnn._reorder_linear_weight).
Tensor linear_pointwise(const Tensor& x, const Tensor& w, const Tensor& bias) {
  static auto op = c10::Dispatcher::singleton().findSchemaOrThrow(
      "mkldnn::_linear_pointwise", "");
  return bucketed(x, [&](const Tensor& in) {
    std::vector<c10::IValue> stack{in, w, bias.defined() ? c10::IValue(bias) : c10::IValue(),
                                   std::string("none"),
                                   c10::List<c10::optional<c10::Scalar>>(), c10::IValue()};
    op.callBoxed(&stack);
    return stack[0].toTensor();
  });
}

// ---------------------------------------------------------------- int4 weights

// Weights of 4 bits in groups of 32 (Q4_1: w = q * scale + min), times activations rounded to
// int8 per group of 32, as llama.cpp multiplies Q4_1 by Q8_1: integer products, one float
// multiply-add per group. q4: [n, k/2] bytes, element i of a group in the low nibble of its
// byte i, element i + 16 in the high one; scale_min: [n, k/32, 2] float16, as GGUF keeps them
// (a step at one row reads all the weights: these bytes count).
constexpr int64_t kGroup = 32;

// x rows -> int8 per group (q8), the group's scale (d8) and the exact sum of its x (xs).
template <typename T>
void quantize_groups(const T* x, int64_t rows, int64_t k, int8_t* q8, float* d8, float* xs) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t g = 0; g < k / kGroup; ++g) {
      const T* v = x + r * k + g * kGroup;
      float amax = 0.f, sum = 0.f;
      for (int64_t i = 0; i < kGroup; ++i) {
        amax = std::max(amax, std::abs(f32(v[i])));
        sum += f32(v[i]);
      }
      const float d = amax / 127.f, inv = d > 0.f ? 1.f / d : 0.f;
      int8_t* q = q8 + (r * k + g * kGroup);
      for (int64_t i = 0; i < kGroup; ++i)
        q[i] = static_cast<int8_t>(std::nearbyint(f32(v[i]) * inv));
      d8[r * (k / kGroup) + g] = d;
      xs[r * (k / kGroup) + g] = sum;
    }
}

inline float half_to_float(at::Half h) {
#ifdef __F16C__
  return _cvtsh_ss(h.x);
#else
  return static_cast<float>(h);
#endif
}

// sum over one group of q4 * q8, as an integer.
#ifdef __AVX2__
inline __m256i group_dot(const uint8_t* w, const int8_t* a) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w));
  const __m256i nib = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw),
                                       _mm256_set1_epi8(0x0f));
  const __m256i av = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a));
  // u8 x s8 pairs to i16 (|15 * 127 * 2| fits), then pairs of those to i32
  return _mm256_madd_epi16(_mm256_maddubs_epi16(nib, av), _mm256_set1_epi16(1));
}
#endif

// Outputs [o0, o1) of NR rows starting at row r0; NR is a compile-time constant so the
// accumulators stay in registers.
template <typename T, int NR>
void int4_block(const int8_t* q8, const float* d8, const float* xs, int64_t r0, int64_t k,
                const uint8_t* q4, const at::Half* scale_min, const T* bias, int64_t o0,
                int64_t o1, T* y, int64_t n) {
  const int64_t groups = k / kGroup;
  for (int64_t o = o0; o < o1; ++o) {
    const uint8_t* w = q4 + o * (k / 2);
    const at::Half* sm = scale_min + o * groups * 2;
    float out[NR] = {};  // the min terms, min * sum(x), per group
#ifdef __AVX2__
    __m256 acc[NR];
    for (int r = 0; r < NR; ++r) acc[r] = _mm256_setzero_ps();
#endif
    for (int64_t g = 0; g < groups; ++g) {
      const float scale = half_to_float(sm[2 * g]), min = half_to_float(sm[2 * g + 1]);
      for (int r = 0; r < NR; ++r) {
        const int64_t rg = (r0 + r) * groups + g;
        out[r] += min * xs[rg];
#ifdef __AVX2__
        const __m256 p = _mm256_cvtepi32_ps(group_dot(w + g * 16, q8 + rg * kGroup));
        acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(scale * d8[rg]), p, acc[r]);
#else
        const int8_t* a = q8 + rg * kGroup;
        int32_t dot = 0;
        for (int64_t i = 0; i < 16; ++i)
          dot += (w[g * 16 + i] & 15) * a[i] + (w[g * 16 + i] >> 4) * a[i + 16];
        out[r] += scale * d8[rg] * static_cast<float>(dot);
#endif
      }
    }
    for (int r = 0; r < NR; ++r) {
      float total = out[r];
#ifdef __AVX2__
      alignas(32) float lanes[8];
      _mm256_store_ps(lanes, acc[r]);
      total += ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) +
               ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
#endif
      const float b = bias != nullptr ? f32(bias[o]) : 0.f;
      y[(r0 + r) * n + o] = round_to<T>(total + b);
    }
  }
}

template <typename T>
void int4_rows(const int8_t* q8, const float* d8, const float* xs, int64_t rows, int64_t k,
               const uint8_t* q4, const at::Half* scale_min, const T* bias, int64_t o0,
               int64_t o1, T* y, int64_t n) {
  for (int64_t r0 = 0; r0 < rows; r0 += 4) {  // up to 4 rows share each weight load
    const int64_t nr = std::min<int64_t>(4, rows - r0);
    auto block = nr == 1 ? int4_block<T, 1> : nr == 2 ? int4_block<T, 2>
               : nr == 3 ? int4_block<T, 3> : int4_block<T, 4>;
    block(q8, d8, xs, r0, k, q4, scale_min, bias, o0, o1, y, n);
  }
}

}  // namespace

// y = x @ W^T (+ bias) for int4 W: [rows, k] -> [rows, n] in x's dtype.
Tensor int4_linear(const Tensor& x_in, const Tensor& q4, const Tensor& scale_min,
                   const Tensor& bias) {
  TORCH_CHECK(x_in.dim() == 2 && q4.dim() == 2, "int4_linear takes [rows, k] inputs");
  const Tensor x = x_in.contiguous();
  const int64_t rows = x.size(0), k = x.size(1), n = q4.size(0);
  TORCH_CHECK(k % kGroup == 0 && q4.size(1) * 2 == k && q4.scalar_type() == at::kByte &&
                  scale_min.scalar_type() == at::kHalf && scale_min.numel() == n * k / kGroup * 2,
              "int4 weights must be [n, k/2] bytes with [n, k/32, 2] float16 scales and mins");
  TORCH_CHECK(!bias.defined() || (bias.scalar_type() == x.scalar_type() && bias.numel() == n),
              "bias must be [n] in x's dtype");
  std::vector<int8_t> q8(rows * k);
  std::vector<float> d8(rows * k / kGroup), xs(rows * k / kGroup);
  Tensor y = at::empty({rows, n}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "int4_linear", [&] {
    quantize_groups<scalar_t>(x.data_ptr<scalar_t>(), rows, k, q8.data(), d8.data(), xs.data());
    const scalar_t* b = bias.defined() ? bias.data_ptr<scalar_t>() : nullptr;
    at::parallel_for(0, n, 64, [&](int64_t o0, int64_t o1) {
      int4_rows<scalar_t>(q8.data(), d8.data(), xs.data(), rows, k, q4.data_ptr<uint8_t>(),
                          scale_min.data_ptr<at::Half>(), b, o0, o1, y.data_ptr<scalar_t>(), n);
    });
  });
  return y;
}

Tensor Linear::operator()(const Tensor& x) const {
  if (fixed_rows <= 0 || x.size(0) == 0) return product(x);
  // batch_invariant.FixedRows: the last call padded with zero rows
  const int64_t rows = x.size(0), pad = (fixed_rows - rows % fixed_rows) % fixed_rows;
  const Tensor padded = pad ? at::constant_pad_nd(x, {0, 0, 0, pad}) : x;
  if (padded.size(0) == fixed_rows) return product(padded).narrow(0, 0, rows);  // one call
  std::vector<Tensor> parts;
  for (const Tensor& part : padded.split(fixed_rows)) parts.push_back(product(part));
  return at::cat(parts).narrow(0, 0, rows);
}

Tensor Linear::product(const Tensor& x) const {
  if (kind == 3) return (*gguf)(x);
  if (kind == 2 && x.size(0) <= max_rows) {
    if (q4) return int4_linear(x, packed, scales_zeros, bias);
    Tensor y = at::_weight_int4pack_mm_for_cpu(x, packed, 32, scales_zeros);
    return bias.defined() ? y.add_(bias) : y;
  }
  if (kind == 0) return at::linear(x, w, bias.defined() ? c10::optional<Tensor>(bias)
                                                        : c10::nullopt);
  if (w32.defined() && x.size(0) >= fp32_rows)
    return linear_pointwise(x.to(at::kFloat), w32, bias32).to(x.scalar_type());
  return linear_pointwise(x, w, bias);
}

}  // namespace tidal_cpu
