// tidal's CPU decode path: a whole decode-only step of a Llama-family model in one call.
//
// Why: on CPU a small model's decode step is bound by per-op dispatch, not by arithmetic
// (SmolLM2-135M runs ~60 eager PyTorch ops a layer at 3-5 us each). Here the projections
// stay ATen calls (int4 / oneDNN kernels, multi-threaded) and everything between them --
// RMSNorm + residual, RoPE, the KV write, paged attention, SiLU * up -- is plain loops.
// Rounding follows the PyTorch path op for op (bf16 after every op it rounds at), and that
// path calls the same attention kernel, so only the RMSNorm sum's order differs (the tests
// find the two bit-identical). Attention reads the paged cache in place: no gather.

#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>

#ifdef __AVX2__
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <type_traits>
#include <vector>

using at::Tensor;
using c10::BFloat16;

namespace {

// Conversions written on the bits so loops over them vectorise; bf16 rounds to nearest even
// as c10::BFloat16 does (NaN stays NaN).
template <typename T>
inline float f32(T x) { return static_cast<float>(x); }
inline float f32(BFloat16 x) {
  uint32_t u = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

template <typename T>
inline T round_to(float x) { return static_cast<T>(x); }
template <>
inline BFloat16 round_to<BFloat16>(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  uint16_t bits = (u & 0x7fffffffu) > 0x7f800000u
                      ? uint16_t(0x7fc0)
                      : static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
  return BFloat16(bits, BFloat16::from_bits());
}

// Dot product over d with 16 independent partial sums (vectorises without -ffast-math).
template <typename A, typename B>
inline float dot(const A* q, const B* k, int64_t d) {
  float acc[16] = {0.f};
  int64_t i = 0;
  for (; i + 16 <= d; i += 16)
    for (int j = 0; j < 16; ++j) acc[j] += f32(q[i + j]) * f32(k[i + j]);
  float s = 0.f;
  for (; i < d; ++i) s += f32(q[i]) * f32(k[i]);
  for (int j = 0; j < 16; ++j) s += acc[j];
  return s;
}

// e^x for softmax, in plain arithmetic so loops over it vectorise (std::exp does not):
// Cephes' polynomial on x - n ln2, scaled by 2^n: a few ulp from expf over its range.
inline float exp_approx(float x) {
  x = std::min(88.0f, std::max(-87.0f, x));
  const float n = std::nearbyint(x * 1.44269504088896341f);
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

// ---------------------------------------------------------------- projections

// linear.py's ROW_CHUNK and row_bucket: oneDNN sees a bounded set of row counts, so its
// per-shape primitive caches stay small.
constexpr int64_t kRowChunk = 256;

int64_t row_bucket(int64_t rows) {
  if (rows <= 16) return rows;
  const int64_t step = int64_t{1} << (64 - __builtin_clzll(rows - 1) - 4);
  return (rows + step - 1) / step * step;
}

// oneDNN's linear over a weight the Python side packed (mkldnn._reorder_linear_weight).
Tensor linear_pointwise(const Tensor& x, const Tensor& w, const Tensor& bias) {
  static auto op = c10::Dispatcher::singleton().findSchemaOrThrow(
      "mkldnn::_linear_pointwise", "");
  const int64_t rows = x.size(0);
  if (rows > kRowChunk) {
    std::vector<Tensor> parts;
    for (const Tensor& part : x.split(kRowChunk)) parts.push_back(linear_pointwise(part, w, bias));
    return at::cat(parts);
  }
  const int64_t padded = row_bucket(rows);
  Tensor in = padded == rows ? x : at::constant_pad_nd(x, {0, 0, 0, padded - rows});
  std::vector<c10::IValue> stack{in, w, bias.defined() ? c10::IValue(bias) : c10::IValue(),
                                 std::string("none"),
                                 c10::List<c10::optional<c10::Scalar>>(), c10::IValue()};
  op.callBoxed(&stack);
  const Tensor y = stack[0].toTensor();
  return padded == rows ? y : y.narrow(0, 0, rows);
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

// One projection in whichever CPU form the Python side packed it: kind 0 = at::linear,
// 1 = oneDNN-packed bf16 weight, 2 = int4 (groups of 32) for <= max_rows rows, else `w`
// packed as in kind 1; `packed` and `scales_zeros` are torch's int4 layout or, with `q4`,
// this file's (int4_linear). Kinds 1 and 2 with `w32` (a packed float32 copy) multiply inputs
// of >= fp32_rows rows in float32, as PackedLinear does.
struct Linear {
  int64_t kind = 0;
  Tensor w, bias, packed, scales_zeros, w32, bias32;
  int64_t max_rows = 0, fp32_rows = 0;
  bool q4 = false;

  Tensor operator()(const Tensor& x) const {
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
};

// ---------------------------------------------------------------- elementwise

// h += y (rounded like a bf16 add) when y is given; x = weight * bf16(h * rsqrt(mean h^2 + eps)).
template <typename T>
void add_rms_norm(T* h, const T* y, const T* weight, T* x, int64_t rows, int64_t dim,
                  float eps) {
  at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      T* hr = h + r * dim;
      if (y != nullptr) {
        const T* yr = y + r * dim;
        for (int64_t i = 0; i < dim; ++i) hr[i] = round_to<T>(f32(hr[i]) + f32(yr[i]));
      }
      const float ss = dot(hr, hr, dim);
      const float inv = 1.f / std::sqrt(ss / dim + eps);
      T* xr = x + r * dim;
      for (int64_t i = 0; i < dim; ++i)
        xr[i] = round_to<T>(f32(weight[i]) * f32(round_to<T>(f32(hr[i]) * inv)));
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

// ---------------------------------------------------------------- paged attention

// Vectors of 16 floats in GCC's vector extension: the compiler picks the widest ISA
// -march=native offers (AVX-512, or two AVX2 halves), with no intrinsics to port.
typedef float v16f __attribute__((vector_size(64)));
typedef float v8f __attribute__((vector_size(32)));
typedef float v4f __attribute__((vector_size(16)));
typedef uint16_t v16u16 __attribute__((vector_size(32)));
typedef uint32_t v16u32 __attribute__((vector_size(64)));

inline v16f load16(const float* p) {
  v16f v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline v16f load16(const BFloat16* p) {  // bf16 is the top half of a float's bits
  v16u16 h;
  std::memcpy(&h, p, sizeof h);
  return reinterpret_cast<v16f>(__builtin_convertvector(h, v16u32) << 16);
}
inline float hsum(v16f v) {
  v8f a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
          __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  v4f b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  return (b[0] + b[1]) + (b[2] + b[3]);
}

// A sequence's context in a [blocks, block_size, hkv, d] cache, for one KV head: `each`
// walks its n tokens from position `first` on (a sliding window's start; 0 otherwise) block
// by block (no division per token), calling f(index from 0, offset in the cache).
struct Paged {
  const int64_t* table;
  int64_t block_size, token_stride, head_offset, first;
  template <typename F>
  void each(int64_t n, F&& f) const {
    for (int64_t t = 0, blk = first / block_size, i0 = first % block_size; t < n; ++blk, i0 = 0) {
      const int64_t base = table[blk] * block_size * token_stride + head_offset;
      const int64_t m = std::min(block_size - i0, n - t);
      for (int64_t i = i0; i < i0 + m; ++i, ++t) f(t, base + i * token_stride);
    }
  }
};

// softmax in place over each of `groups` rows of n scores.
inline void softmax_rows(float* scores, int64_t groups, int64_t n) {
  for (int64_t j = 0; j < groups; ++j) {
    float* s = scores + j * n;
    const float mx = *std::max_element(s, s + n);
    for (int64_t t = 0; t < n; ++t) s[t] = exp_approx(s[t] - mx);
    const float inv = 1.f / std::accumulate(s, s + n, 0.f);
    for (int64_t t = 0; t < n; ++t) s[t] *= inv;
  }
}

// One (sequence, KV head) task for head_dim a multiple of 16 (up to 256): each K and V row
// is loaded once as d/16 vectors and serves every query head of the group. NV = d / 16 when
// known at compile time (the loops over a row then unroll), 0 to read it from d.
template <typename T, int NV>
void attend_vec(const float* qf, const T* k_cache, const T* v_cache, const Paged& ctx, int64_t n,
                int64_t groups, int64_t d, float* scores, float* acc) {
  const int64_t nv = NV > 0 ? NV : d / 16;
  v16f row[NV > 0 ? NV : 16];
  ctx.each(n, [&](int64_t t, int64_t off) {
    const T* k = k_cache + off;
    for (int64_t c = 0; c < nv; ++c) row[c] = load16(k + 16 * c);
    for (int64_t j = 0; j < groups; ++j) {
      const float* qj = qf + j * d;
      v16f sum = load16(qj) * row[0];
      for (int64_t c = 1; c < nv; ++c) sum += load16(qj + 16 * c) * row[c];
      scores[j * n + t] = hsum(sum);
    }
  });
  softmax_rows(scores, groups, n);
  v16f out[16 * 16];  // groups * nv <= 16 * 16: checked by the caller
  std::fill(out, out + groups * nv, v16f{});
  ctx.each(n, [&](int64_t t, int64_t off) {
    const T* v = v_cache + off;
    for (int64_t c = 0; c < nv; ++c) row[c] = load16(v + 16 * c);
    for (int64_t j = 0; j < groups; ++j) {
      const float p = scores[j * n + t];
      for (int64_t c = 0; c < nv; ++c) out[j * nv + c] += p * row[c];
    }
  });
  std::memcpy(acc, out, sizeof(float) * groups * d);
}

// Any head_dim, one element at a time.
template <typename T>
void attend_scalar(const float* qf, const T* k_cache, const T* v_cache, const Paged& ctx,
                   int64_t n, int64_t groups, int64_t d, float* scores, float* acc) {
  ctx.each(n, [&](int64_t t, int64_t off) {
    for (int64_t j = 0; j < groups; ++j) scores[j * n + t] = dot(qf + j * d, k_cache + off, d);
  });
  softmax_rows(scores, groups, n);
  std::fill(acc, acc + groups * d, 0.f);
  ctx.each(n, [&](int64_t t, int64_t off) {
    const T* v = v_cache + off;
    for (int64_t j = 0; j < groups; ++j) {
      const float p = scores[j * n + t];
      for (int64_t i = 0; i < d; ++i) acc[j * d + i] += p * f32(v[i]);
    }
  });
}

// q: rows of [heads, d] at `q_stride` apart; caches [blocks, block_size, hkv, d];
// tables [B, W] int64; lens [B]. One task per (sequence, KV head) reads that head's context
// straight from its blocks and serves every query head of its group. window > 0: only the
// last `window` positions of each context (a sliding-window layer).
template <typename T>
void paged_attention(const T* q, int64_t q_stride, const T* k_cache, const T* v_cache,
                     const int64_t* tables, int64_t table_width, const int64_t* lens,
                     int64_t batch, int64_t heads, int64_t hkv, int64_t d, int64_t block_size,
                     float scale, int64_t window, T* out) {
  const int64_t groups = heads / hkv;
  constexpr bool vectorisable = std::is_same_v<T, float> || std::is_same_v<T, BFloat16>;
  const bool vec = vectorisable && d % 16 == 0 && d <= 256 && groups * (d / 16) <= 256;
  at::parallel_for(0, batch * hkv, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> qf, scores, acc;
    for (int64_t task = t0; task < t1; ++task) {
      const int64_t b = task / hkv, g = task % hkv;
      const int64_t first = window > 0 && lens[b] > window ? lens[b] - window : 0;
      const int64_t n = lens[b] - first;
      const Paged ctx{tables + b * table_width, block_size, hkv * d, g * d, first};
      qf.resize(groups * d);
      scores.resize(groups * n);
      acc.resize(groups * d);
      for (int64_t j = 0; j < groups; ++j)
        for (int64_t i = 0; i < d; ++i)
          qf[j * d + i] = f32(q[b * q_stride + (g * groups + j) * d + i]) * scale;
      float *qp = qf.data(), *sp = scores.data(), *ap = acc.data();
      if constexpr (vectorisable) {
        if (vec && d == 64) {
          attend_vec<T, 4>(qp, k_cache, v_cache, ctx, n, groups, d, sp, ap);
        } else if (vec && d == 128) {
          attend_vec<T, 8>(qp, k_cache, v_cache, ctx, n, groups, d, sp, ap);
        } else if (vec) {
          attend_vec<T, 0>(qp, k_cache, v_cache, ctx, n, groups, d, sp, ap);
        } else {
          attend_scalar<T>(qp, k_cache, v_cache, ctx, n, groups, d, sp, ap);
        }
      } else {
        attend_scalar<T>(qp, k_cache, v_cache, ctx, n, groups, d, sp, ap);
      }
      for (int64_t j = 0; j < groups; ++j)
        for (int64_t i = 0; i < d; ++i)
          out[(b * heads + g * groups + j) * d + i] = round_to<T>(acc[j * d + i]);
    }
  });
}

template <typename T>
void write_kv(const T* qkv, int64_t row_stride, int64_t offset, const int64_t* slots,
              int64_t rows, int64_t width, T* cache) {
  for (int64_t r = 0; r < rows; ++r)
    std::copy_n(qkv + r * row_stride + offset, width, cache + slots[r] * width);
}

void check_cache(const Tensor& t, at::ScalarType dtype) {
  TORCH_CHECK(t.is_contiguous() && t.scalar_type() == dtype && t.dim() == 4,
              "KV cache must be a contiguous [blocks, block_size, kv_heads, head_dim] tensor "
              "of the model's dtype");
}

// The kernel reads blocks by raw offset: a context longer than its table or a block id out
// of the cache would read foreign memory, so both are refused up front.
void check_tables(const Tensor& tables, const Tensor& lens, int64_t batch, int64_t num_blocks,
                  int64_t block_size) {
  TORCH_CHECK(tables.dim() == 2 && tables.size(0) == batch && lens.numel() == batch,
              "one block table and one context length per sequence");
  const int64_t* t = tables.data_ptr<int64_t>();
  const int64_t* n = lens.data_ptr<int64_t>();
  for (int64_t b = 0; b < batch; ++b)
    TORCH_CHECK(n[b] >= 1 && n[b] <= tables.size(1) * block_size,
                "context length ", n[b], " does not fit its block table");
  for (int64_t i = 0; i < tables.numel(); ++i)
    TORCH_CHECK(t[i] >= 0 && t[i] < num_blocks, "block id ", t[i], " is not in the cache");
}

}  // namespace

// ---------------------------------------------------------------- the decoder

struct Layer {
  Tensor norm1, norm2;
  Linear qkv, o, gate_up, down;
  int64_t window;  // sliding window (0: full attention)
};

class Decoder {
 public:
  Decoder(Tensor embed, Tensor final_norm, Linear lm_head, Tensor cos, Tensor sin,
          int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t intermediate, double eps)
      : embed_(embed), final_norm_(final_norm), lm_head_(lm_head), cos_(cos.contiguous()),
        sin_(sin.contiguous()), heads_(heads), hkv_(kv_heads), d_(head_dim),
        inter_(intermediate), eps_(static_cast<float>(eps)) {
    TORCH_CHECK(embed.scalar_type() == at::kBFloat16 || embed.scalar_type() == at::kFloat,
                "the CPU decoder runs bfloat16 and float32 models");
    TORCH_CHECK(heads % kv_heads == 0, "heads must be a multiple of kv heads");
    TORCH_CHECK(cos.dim() == 2 && cos.sizes() == sin.sizes() && cos.size(1) % 2 == 0 &&
                    cos.size(1) <= head_dim && cos.scalar_type() == at::kFloat,
                "RoPE tables must be float32 [positions, rotary_dim <= head_dim], rotary_dim even");
  }

  void add_layer(Tensor norm1, Tensor norm2, Linear qkv, Linear o, Linear gate_up, Linear down,
                 int64_t window) {
    layers_.push_back({norm1, norm2, qkv, o, gate_up, down, window});
  }

  // One decode-only step: logits (float32) of `logits_rows` among the B one-token rows.
  Tensor forward(Tensor ids, Tensor positions, Tensor slots, Tensor tables, Tensor lens,
                 const std::vector<Tensor>& k_caches, const std::vector<Tensor>& v_caches,
                 Tensor logits_rows, double scale, int64_t block_size) {
    if (embed_.scalar_type() == at::kFloat)
      return step<float>(ids, positions, slots, tables, lens, k_caches, v_caches, logits_rows,
                         scale, block_size);
    return step<BFloat16>(ids, positions, slots, tables, lens, k_caches, v_caches, logits_rows,
                          scale, block_size);
  }

 private:
  template <typename T>
  Tensor step(Tensor ids, Tensor positions, Tensor slots, Tensor tables, Tensor lens,
              const std::vector<Tensor>& k_caches, const std::vector<Tensor>& v_caches,
              Tensor logits_rows, double scale, int64_t block_size) {
    TORCH_CHECK(k_caches.size() == layers_.size() && v_caches.size() == layers_.size(),
                "one K and one V cache per layer");
    ids = ids.to(at::kLong).contiguous();
    positions = positions.to(at::kLong).contiguous();
    slots = slots.to(at::kLong).contiguous();
    tables = tables.to(at::kLong).contiguous();
    lens = lens.to(at::kLong).contiguous();
    const int64_t rows = ids.size(0), hid = embed_.size(1);
    check_tables(tables, lens, rows, k_caches[0].size(0), block_size);
    const int64_t num_slots = k_caches[0].size(0) * block_size;
    for (int64_t r = 0; r < rows; ++r)  // write_kv writes by raw offset too
      TORCH_CHECK(slots.data_ptr<int64_t>()[r] >= 0 && slots.data_ptr<int64_t>()[r] < num_slots,
                  "slot ", slots.data_ptr<int64_t>()[r], " is not in the cache");
    const int64_t qkv_width = (heads_ + 2 * hkv_) * d_, kv_width = hkv_ * d_;
    Tensor h = embed_.index_select(0, ids).contiguous();
    Tensor x = at::empty_like(h);
    Tensor cos = cos_.index_select(0, positions), sin = sin_.index_select(0, positions);
    Tensor attn = at::empty({rows, heads_ * d_}, h.options());
    Tensor act = at::empty({rows, inter_}, h.options());
    Tensor y;  // the last projection's output, added to h by the next norm
    for (size_t l = 0; l < layers_.size(); ++l) {
      const Layer& L = layers_[l];
      check_cache(k_caches[l], h.scalar_type());
      check_cache(v_caches[l], h.scalar_type());
      add_rms_norm<T>(h.data_ptr<T>(), y.defined() ? y.data_ptr<T>() : nullptr,
                      L.norm1.data_ptr<T>(), x.data_ptr<T>(), rows, hid, eps_);
      Tensor qkv = L.qkv(x).contiguous();
      T* qp = qkv.data_ptr<T>();
      rope<T>(qp, qkv_width, cos.data_ptr<float>(), sin.data_ptr<float>(), rows, heads_ + hkv_,
              d_, cos_.size(1));
      write_kv<T>(qp, qkv_width, heads_ * d_, slots.data_ptr<int64_t>(), rows, kv_width,
                  k_caches[l].data_ptr<T>());
      write_kv<T>(qp, qkv_width, (heads_ + hkv_) * d_, slots.data_ptr<int64_t>(), rows,
                  kv_width, v_caches[l].data_ptr<T>());
      paged_attention<T>(qp, qkv_width, k_caches[l].data_ptr<T>(), v_caches[l].data_ptr<T>(),
                         tables.data_ptr<int64_t>(), tables.size(1), lens.data_ptr<int64_t>(),
                         rows, heads_, hkv_, d_, block_size, static_cast<float>(scale),
                         L.window, attn.data_ptr<T>());
      y = L.o(attn).contiguous();
      add_rms_norm<T>(h.data_ptr<T>(), y.data_ptr<T>(), L.norm2.data_ptr<T>(), x.data_ptr<T>(),
                      rows, hid, eps_);
      Tensor gate_up = L.gate_up(x).contiguous();
      // ATen's vectorised SiLU: its exp rounds as the PyTorch path's does.
      at::mul_out(act, at::silu(gate_up.narrow(1, 0, inter_)),
                  gate_up.narrow(1, inter_, inter_));
      y = L.down(act).contiguous();
    }
    // The final norm of h + the last MLP output; the LM head only for the rows that sample.
    add_rms_norm<T>(h.data_ptr<T>(), y.data_ptr<T>(), final_norm_.data_ptr<T>(), x.data_ptr<T>(),
                    rows, hid, eps_);
    if (logits_rows.size(0) != rows) x = x.index_select(0, logits_rows.to(at::kLong));
    return lm_head_(x).to(at::kFloat);
  }

  Tensor embed_, final_norm_;
  Linear lm_head_;
  Tensor cos_, sin_;
  int64_t heads_, hkv_, d_, inter_;
  float eps_;
  std::vector<Layer> layers_;
};

// Paged decode attention on its own: the PyTorch path's decode attention on CPU.
Tensor paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor tables,
                              Tensor lens, double scale, int64_t window) {
  TORCH_CHECK(q.dim() == 3, "q must be [batch, heads, head_dim]");
  check_cache(k_cache, q.scalar_type());
  check_cache(v_cache, q.scalar_type());
  q = q.contiguous();
  tables = tables.to(at::kLong).contiguous();
  lens = lens.to(at::kLong).contiguous();
  const int64_t batch = q.size(0), heads = q.size(1), d = q.size(2);
  TORCH_CHECK(heads % k_cache.size(2) == 0 && d == k_cache.size(3),
              "q's heads must be a multiple of the cache's KV heads, with the same head_dim");
  check_tables(tables, lens, batch, k_cache.size(0), k_cache.size(1));
  Tensor out = at::empty_like(q);
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, q.scalar_type(), "paged_decode_attention", [&] {
    paged_attention<scalar_t>(q.data_ptr<scalar_t>(), heads * d, k_cache.data_ptr<scalar_t>(),
                              v_cache.data_ptr<scalar_t>(), tables.data_ptr<int64_t>(),
                              tables.size(1), lens.data_ptr<int64_t>(), batch, heads,
                              k_cache.size(2), d, k_cache.size(1), static_cast<float>(scale),
                              window, out.data_ptr<scalar_t>());
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  py::class_<Linear>(m, "Linear")
      .def(py::init([](int64_t kind, Tensor w, c10::optional<Tensor> bias,
                       c10::optional<Tensor> packed, c10::optional<Tensor> scales_zeros,
                       int64_t max_rows, c10::optional<Tensor> w32,
                       c10::optional<Tensor> bias32, int64_t fp32_rows, bool q4) {
             Linear l;
             l.q4 = q4;
             l.kind = kind;
             l.w = w;
             l.bias = bias.value_or(Tensor());
             l.packed = packed.value_or(Tensor());
             l.scales_zeros = scales_zeros.value_or(Tensor());
             l.max_rows = max_rows;
             l.w32 = w32.value_or(Tensor());
             l.bias32 = bias32.value_or(Tensor());
             l.fp32_rows = fp32_rows;
             return l;
           }),
           py::arg("kind"), py::arg("weight"), py::arg("bias"), py::arg("packed") = py::none(),
           py::arg("scales_zeros") = py::none(), py::arg("max_rows") = 0,
           py::arg("w32") = py::none(), py::arg("bias32") = py::none(),
           py::arg("fp32_rows") = 0, py::arg("q4") = false)
      .def("__call__", &Linear::operator());
  py::class_<Decoder>(m, "Decoder")
      .def(py::init<Tensor, Tensor, Linear, Tensor, Tensor, int64_t, int64_t, int64_t, int64_t,
                    double>())
      .def("add_layer", &Decoder::add_layer)
      .def("forward", &Decoder::forward, py::call_guard<py::gil_scoped_release>());
  m.def("paged_decode_attention", &paged_decode_attention, py::arg("q"), py::arg("k_cache"),
        py::arg("v_cache"), py::arg("tables"), py::arg("lens"), py::arg("scale"),
        py::arg("window") = 0, py::call_guard<py::gil_scoped_release>());
  m.def("int4_linear", [](Tensor x, Tensor q4, Tensor scale_min, c10::optional<Tensor> bias) {
    return int4_linear(x, q4, scale_min, bias.value_or(Tensor()));
  }, py::arg("x"), py::arg("q4"), py::arg("scale_min"), py::arg("bias") = py::none(),
        py::call_guard<py::gil_scoped_release>());
}
