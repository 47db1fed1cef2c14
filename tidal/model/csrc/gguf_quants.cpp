// GGUF-quantized weights at decode sizes: y = x @ W^T with W in its GGUF block format
// (gguf_formats.h), as ggml multiplies them: x rounded to int8 per group of 32 with a float
// scale, integer products per group, one float multiply-add per group and row. The K-quants
// take the same per-32 activations (ggml uses one scale per 256): finer, and one code path.
// Steps of many rows multiply tiles of dequantized rows (`tiled`) with oneDNN instead.

#include "tidal_cpu.h"
#include "gguf_formats.h"

#include <type_traits>
#include <utility>

#if defined(TIDAL_GGUF_AVX2) && defined(__AVX512F__) && defined(__AVX512BW__) && \
    defined(__AVX512DQ__) && defined(__AVX512VNNI__)
#define TIDAL_GGUF_AVX512 1  // -march=native on a CPU with AVX-512 VNNI
#endif

namespace tidal_cpu {
namespace {

using namespace gguf;

constexpr int kMaxRows = 8;           // activation rows sharing each decoded weight group
constexpr int64_t kTileBytes = 1 << 18;  // weight bytes a task keeps in L2 across row groups
constexpr int64_t kAheadBytes = 4096;    // how far ahead of the block in use to prefetch

// A decode step streams every weight from memory once, faster than the hardware prefetcher
// alone fetches it: each block asks for the bytes kAheadBytes ahead of it, a few lines at a
// time (a burst would overrun the core's outstanding misses).
struct Prefetch {
  const uint8_t* ahead;  // the row's first byte + kAheadBytes
  int64_t block_bytes;   // the row's bytes per block, in either layout
  void block(int64_t b) const {
    for (int64_t c = 0; c < block_bytes; c += 64)
      __builtin_prefetch(ahead + b * block_bytes + c, 0, 3);
  }
};

// x rows rounded to int8 per group: q, the group's scale d and the exact sum of its x;
// d8 (filled for the AVX-512 integer path) holds each d 8 times over, so a kernel loads a
// group pair's scales as one vector.
struct Activations {
  std::vector<int8_t> q;
  std::vector<float> d, sum, d8;
};

template <typename T>
Activations quantize(const T* x, int64_t rows, int64_t k) {
  const int64_t groups = rows * k / kGroup;
  Activations a{std::vector<int8_t>(rows * k), std::vector<float>(groups),
                std::vector<float>(groups)};
  for (int64_t g = 0; g < groups; ++g) {
    const T* v = x + g * kGroup;
    float amax = 0.f, sum = 0.f;
    for (int64_t i = 0; i < kGroup; ++i) {
      amax = std::max(amax, std::abs(f32(v[i])));
      sum += f32(v[i]);
    }
    const float d = amax / 127.f, inv = d > 0.f ? 1.f / d : 0.f;
    for (int64_t i = 0; i < kGroup; ++i)
      a.q[g * kGroup + i] = static_cast<int8_t>(std::nearbyint(f32(v[i]) * inv));
    a.d[g] = d;
    a.sum[g] = sum;
  }
  return a;
}

#ifdef TIDAL_GGUF_AVX2
// Sums of 4 adjacent u8 x s8 products as int32 lanes (lane i: weights 4i..4i+3).
inline __m256i dot_u8s8(__m256i u, __m256i s) {
#if defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s);
#elif defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#else
  // pairs to int16 cannot saturate: |q| <= 128 and |a| <= 127
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

inline float hsum(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}
#endif

// Block b's scales with each group's centre taken off q and put into m (see kCenter).
template <typename F>
inline void centred_scales(const Field* f, int64_t b, float (*s)[2], float* m) {
  F::scales(f, b, s, m);
  for (int j = 0; j < F::kGroups; ++j) m[j] += F::kCenter * s[j][0];
}

#ifdef TIDAL_GGUF_AVX2
// One row's blocks against NR activation rows, one group of 32 a step; adds each row's sum
// to out[r].
template <typename F, int NR>
inline void dot_avx2(const Activations& a, int64_t r0, const Field* f, const Prefetch& pf,
                     int64_t nb, int64_t groups, float* out) {
  float s[F::kGroups][2], m[F::kGroups];
  __m256 acc[NR];
  for (int r = 0; r < NR; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    pf.block(b);
    centred_scales<F>(f, b, s, m);
#pragma GCC unroll 8
    for (int j = 0; j < F::kGroups; ++j) {
      __m256i q = F::vec(f, b, j);
      if (F::kCenter) q = _mm256_sub_epi8(q, _mm256_set1_epi8(F::kCenter));
      const __m256i u = _mm256_abs_epi8(q);  // u8 x s8 products: the sign moves onto x
      const __m256 sv = _mm256_setr_m128(_mm_set1_ps(s[j][0]), _mm_set1_ps(s[j][1]));
      const int64_t g = b * F::kGroups + j;
      for (int r = 0; r < NR; ++r) {
        const int64_t rg = (r0 + r) * groups + g;
        const __m256i x8 = _mm256_sign_epi8(
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(&a.q[rg * kGroup])), q);
        const __m256 p = _mm256_cvtepi32_ps(dot_u8s8(u, x8));
        acc[r] = _mm256_fmadd_ps(p, _mm256_mul_ps(sv, _mm256_set1_ps(a.d[rg])), acc[r]);
        if (F::kMin && F::kGroups == 1) out[r] += m[j] * a.sum[rg];
      }
    }
    if (F::kMin && F::kGroups == 8) {  // the block's 8 min terms in one multiply-add
      const __m256 mv = _mm256_loadu_ps(m);
      for (int r = 0; r < NR; ++r)
        acc[r] = _mm256_fmadd_ps(mv, _mm256_loadu_ps(&a.sum[(r0 + r) * groups + b * 8]), acc[r]);
    }
  }
  for (int r = 0; r < NR; ++r) out[r] += hsum(acc[r]);
}
#else
// The same without AVX2.
template <typename F, int NR>
inline void dot_scalar(const Activations& a, int64_t r0, const Field* f, const Prefetch& pf,
                       int64_t nb, int64_t groups, float* out) {
  float s[F::kGroups][2], m[F::kGroups];
  int8_t q[kGroup];
  for (int64_t b = 0; b < nb; ++b) {
    pf.block(b);
    centred_scales<F>(f, b, s, m);
    for (int j = 0; j < F::kGroups; ++j) {
      F::scalar(f, b, j, q);
      for (int i = 0; i < kGroup; ++i) q[i] = static_cast<int8_t>(q[i] - F::kCenter);
      const int64_t g = b * F::kGroups + j;
      for (int r = 0; r < NR; ++r) {
        const int64_t rg = (r0 + r) * groups + g;
        const int8_t* x8 = &a.q[rg * kGroup];
        int32_t lo = 0, hi = 0;
        for (int i = 0; i < 16; ++i) {
          lo += q[i] * x8[i];
          hi += q[i + 16] * x8[i + 16];
        }
        out[r] += a.d[rg] * (s[j][0] * lo + s[j][1] * hi) + m[j] * a.sum[rg];
      }
    }
  }
}
#endif

#ifdef TIDAL_GGUF_AVX512
// One row's K-quant blocks against NR activation rows, two groups of 32 a step: a group
// pair's 64 quants and 64 activations fill a 512-bit register, and one VNNI instruction
// takes their products (16 int32 sums of 4: lanes 0-7 the first group, 8-15 the second).
template <typename F, int NR>
inline void dot_k512(const Activations& a, int64_t r0, const Field* f, const Prefetch& pf,
                     int64_t nb, int64_t groups, float* out) {
  __m512 acc[NR];
  for (int r = 0; r < NR; ++r) acc[r] = _mm512_setzero_ps();
  float s[F::kGroups][2], m[F::kGroups];
  const __m512i zero = _mm512_setzero_si512();
  for (int64_t b = 0; b < nb; ++b) {
    pf.block(b);
    centred_scales<F>(f, b, s, m);
#pragma GCC unroll 4
    for (int j = 0; j < F::kGroups; j += 2) {
      __m256i q0 = F::vec(f, b, j), q1 = F::vec(f, b, j + 1);
      if (F::kCenter) {
        q0 = _mm256_sub_epi8(q0, _mm256_set1_epi8(F::kCenter));
        q1 = _mm256_sub_epi8(q1, _mm256_set1_epi8(F::kCenter));
      }
      const __m512i q = _mm512_inserti64x4(_mm512_castsi256_si512(q0), q1, 1);
      const __m512i u = _mm512_abs_epi8(q);  // u8 x s8 products: the sign moves onto x
      const __mmask64 negative = _mm512_movepi8_mask(q);
      const __m512 sv = _mm512_insertf32x8(
          _mm512_castps256_ps512(_mm256_setr_m128(_mm_set1_ps(s[j][0]), _mm_set1_ps(s[j][1]))),
          _mm256_setr_m128(_mm_set1_ps(s[j + 1][0]), _mm_set1_ps(s[j + 1][1])), 1);
      const int64_t g = b * F::kGroups + j;
      for (int r = 0; r < NR; ++r) {
        const int64_t rg = (r0 + r) * groups + g;
        __m512i x8 = _mm512_loadu_si512(&a.q[rg * kGroup]);  // groups g and g + 1
        x8 = _mm512_mask_sub_epi8(x8, negative, zero, x8);
        const __m512 p = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(zero, u, x8));
        const __m512 dv = _mm512_loadu_ps(&a.d8[rg * 8]);  // d of groups g and g + 1
        acc[r] = _mm512_fmadd_ps(p, _mm512_mul_ps(sv, dv), acc[r]);
      }
    }
    if (F::kMin) {  // the block's 8 min terms in one multiply-add (the upper lanes 0)
      const __m512 mv = _mm512_zextps256_ps512(_mm256_loadu_ps(m));
      for (int r = 0; r < NR; ++r)
        acc[r] = _mm512_fmadd_ps(
            mv, _mm512_zextps256_ps512(_mm256_loadu_ps(&a.sum[(r0 + r) * groups + b * 8])),
            acc[r]);
    }
  }
  for (int r = 0; r < NR; ++r) out[r] += _mm512_reduce_add_ps(acc[r]);
}
#endif

// y[r0 .. r0+NR, o0 .. o1): NR is a compile-time constant so the accumulators stay in registers.
template <typename F, typename T, int NR>
void dot_rows(const Activations& a, int64_t r0, const uint8_t* w, int64_t row_bytes, int64_t k,
              bool planar, const T* bias, int64_t o0, int64_t o1, T* y, int64_t n) {
  const int64_t groups = k / kGroup, nb = k / F::kBlock;
  for (int64_t o = o0; o < o1; ++o) {
    const Prefetch pf{w + o * row_bytes + kAheadBytes, row_bytes / nb};
    Field f[F::kFields];
    fields<F>(w + o * row_bytes, nb, planar, f);
    float out[NR] = {};  // each activation row's dot product with this weight row
#if defined(TIDAL_GGUF_AVX512)
    if constexpr (F::kGroups == 8) {  // K-quants: two groups a 512-bit step
      dot_k512<F, NR>(a, r0, f, pf, nb, groups, out);
    } else {
      dot_avx2<F, NR>(a, r0, f, pf, nb, groups, out);
    }
#elif defined(TIDAL_GGUF_AVX2)
    dot_avx2<F, NR>(a, r0, f, pf, nb, groups, out);
#else
    dot_scalar<F, NR>(a, r0, f, pf, nb, groups, out);
#endif
    for (int r = 0; r < NR; ++r)
      y[(r0 + r) * n + o] = round_to<T>(out[r] + (bias != nullptr ? f32(bias[o]) : 0.f));
  }
}

// dot_rows for nr (1..kMaxRows) rows.
template <typename F, typename T, int... N>
auto row_kernel(int64_t nr, std::integer_sequence<int, N...>) {
  static constexpr decltype(&dot_rows<F, T, 1>) kernels[] = {dot_rows<F, T, N + 1>...};
  return kernels[nr - 1];
}

// y[:, :w.size(0)] of a [rows, ld] output for one weight, over activations already quantized.
template <typename F, typename T>
void linear(const Activations& a, int64_t rows, int64_t k, const Tensor& w, bool planar,
            const T* b, T* yp, int64_t ld) {
  const int64_t n = w.size(0), row_bytes = w.size(1);
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const int64_t tile = std::max<int64_t>(8, kTileBytes / row_bytes);
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t o0 = begin; o0 < end; o0 += tile) {  // a tile's weights stay cached
      const int64_t o1 = std::min(end, o0 + tile);
      for (int64_t r0 = 0; r0 < rows; r0 += kMaxRows) {
        const int64_t nr = std::min<int64_t>(kMaxRows, rows - r0);
        const auto run = row_kernel<F, T>(nr, std::make_integer_sequence<int, kMaxRows>());
        run(a, r0, wp, row_bytes, k, planar, b, o0, o1, yp, ld);
      }
    }
  });
}

// Group j of block b as floats: v[i] = s * q[i] + m.
template <typename F>
inline void group_values(const Field* f, int64_t b, int j, const float* s, float m, float* v) {
#ifdef TIDAL_GGUF_AVX2
  const __m256i q = F::vec(f, b, j);
  const __m128i lo = _mm256_castsi256_si128(q), hi = _mm256_extracti128_si256(q, 1);
  const __m128i eighths[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
  for (int c = 0; c < 4; ++c) {
    const __m256 qf = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(eighths[c]));
    _mm256_storeu_ps(v + 8 * c, _mm256_fmadd_ps(_mm256_set1_ps(s[c / 2]), qf, _mm256_set1_ps(m)));
  }
#else
  int8_t q[kGroup];
  F::scalar(f, b, j, q);
  for (int i = 0; i < kGroup; ++i) v[i] = s[i / 16] * static_cast<float>(q[i]) + m;
#endif
}

// Rows of W as floats into out: row r is W's row ids[r], or start + r without ids.
template <typename F, typename T>
void dequantize(const Tensor& w, bool planar, int64_t start, const int64_t* ids, Tensor& out) {
  const int64_t rows = out.size(0), k = out.size(1), row_bytes = w.size(1);
  const int64_t nb = k / F::kBlock;
  const uint8_t* wp = w.data_ptr<uint8_t>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, rows, 8, [&](int64_t r0, int64_t r1) {
    float s[F::kGroups][2], m[F::kGroups], v[kGroup];
    for (int64_t r = r0; r < r1; ++r) {
      Field f[F::kFields];
      fields<F>(wp + (ids != nullptr ? ids[r] : start + r) * row_bytes, nb, planar, f);
      for (int64_t b = 0; b < nb; ++b) {
        F::scales(f, b, s, m);
        for (int j = 0; j < F::kGroups; ++j) {
          T* dst = op + r * k + (b * F::kGroups + j) * kGroup;
          if constexpr (std::is_same_v<T, float>) {
            group_values<F>(f, b, j, s[j], m[j], dst);
          } else {
            group_values<F>(f, b, j, s[j], m[j], v);
            for (int i = 0; i < kGroup; ++i) dst[i] = round_to<T>(v[i]);
          }
        }
      }
    }
  });
}

// Calls fn.template operator()<Format>() for a ggml type id.
template <typename Fn>
void with_format(int64_t type, Fn&& fn) {
  switch (type) {
    case 2: return fn(Q4_0{});
    case 3: return fn(Q4_1{});
    case 6: return fn(Q5_0{});
    case 7: return fn(Q5_1{});
    case 8: return fn(Q8_0{});
    case 12: return fn(Q4_K{});
    case 13: return fn(Q5_K{});
    case 14: return fn(Q6_K{});
    default: TORCH_CHECK(false, "no GGUF kernel for ggml type ", type);
  }
}

// k of a [n, row_bytes] weight of format F, checked against the row's bytes.
template <typename F>
int64_t row_length(const Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte && w.is_contiguous(),
              "GGUF weights must be contiguous [n, row_bytes] uint8");
  TORCH_CHECK(w.size(1) % F::kBytes == 0, "a GGUF row of ", w.size(1),
              " bytes is not a whole number of ", F::kBytes, "-byte blocks");
  return w.size(1) / F::kBytes * F::kBlock;
}

// Rows of a part into out (float or bf16): W's rows ids, or start .. start + out.size(0).
void rows_into(const GGUFPart& p, int64_t start, const Tensor& ids, Tensor& out) {
  with_format(p.type, [&](auto format) {
    using F = decltype(format);
    TORCH_CHECK(out.dim() == 2 && out.is_contiguous() && out.size(1) == row_length<F>(p.data),
                "GGUF rows: out must be contiguous [rows, k]");
    const int64_t* idp = nullptr;
    if (ids.defined()) {
      TORCH_CHECK(ids.scalar_type() == at::kLong && ids.is_contiguous() &&
                      ids.numel() == out.size(0), "GGUF rows: ids must be [rows] int64");
      idp = ids.data_ptr<int64_t>();
      for (int64_t r = 0; r < ids.numel(); ++r)
        TORCH_CHECK(idp[r] >= 0 && idp[r] < p.data.size(0), "row ", idp[r], " is not in W");
    } else {
      TORCH_CHECK(start >= 0 && start + out.size(0) <= p.data.size(0),
                  "GGUF rows: out must lie within W's rows");
    }
    AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, out.scalar_type(), "gguf_rows", [&] {
      dequantize<F, scalar_t>(p.data, p.planar, start, idp, out);
    });
  });
}

// Steps of many rows: tiles of dequantized weight rows that oneDNN multiplies (the extra
// memory stays one tile however large the weight; the rows bucketed as every CPU GEMM's)
// by x rounded to the int8 grid the
// integer kernels use. In float32 both paths compute the same sums up to float32 rounding,
// so a sequence's tokens do not depend on whether its prompt ran in one step, in chunks or
// partly from the prefix cache; with tile_bf16 (CPUs with AMX, where bf16 GEMMs run
// several times faster) x and the tile are rounded to bf16 too, ~0.3% apart.
Tensor tiled(const Tensor& x, const GGUFProjection& g) {
  const int64_t rows = x.size(0), k = x.size(1);
  Tensor xs = at::empty({rows, k}, x.options().dtype(at::kFloat));
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "gguf_tiled", [&] {
    const Activations a = quantize<scalar_t>(x.data_ptr<scalar_t>(), rows, k);
    float* out = xs.data_ptr<float>();
    at::parallel_for(0, rows * k / kGroup, 256, [&](int64_t g0, int64_t g1) {
      for (int64_t grp = g0; grp < g1; ++grp)
        for (int64_t i = 0; i < kGroup; ++i)
          out[grp * kGroup + i] = a.d[grp] * static_cast<float>(a.q[grp * kGroup + i]);
    });
  });
  if (g.tile_bf16 && x.scalar_type() == at::kBFloat16) xs = xs.to(at::kBFloat16);
  Tensor y = at::empty({rows, g.out_features}, xs.options());
  Tensor tile = at::empty({g.tile_rows, k}, xs.options());
  int64_t col = 0;
  for (const GGUFPart& p : g.parts) {
    for (int64_t a = 0; a < p.data.size(0); a += g.tile_rows) {
      const int64_t n = std::min(g.tile_rows, p.data.size(0) - a);
      Tensor t = tile.narrow(0, 0, n);
      rows_into(p, a, Tensor(), t);
      y.narrow(1, col + a, n).copy_(bucketed(xs, [&](const Tensor& in) {
        return at::linear(in, t);
      }));
    }
    col += p.data.size(0);
  }
  if (g.bias.defined()) y.add_(g.bias.to(y.scalar_type()));
  return y.scalar_type() == x.scalar_type() ? y : y.to(x.scalar_type());
}

}  // namespace

GGUFProjection::GGUFProjection(std::vector<GGUFPart> parts_, Tensor bias_, int64_t max_rows_,
                               int64_t tile_rows_, bool tile_bf16_)
    : parts(std::move(parts_)), bias(bias_), max_rows(max_rows_), tile_rows(tile_rows_),
      tile_bf16(tile_bf16_) {
  TORCH_CHECK(!parts.empty() && tile_rows > 0, "a GGUF projection needs parts and tile_rows > 0");
  for (const GGUFPart& p : parts) {
    with_format(p.type, [&](auto format) {
      using F = decltype(format);
      const int64_t k = row_length<F>(p.data);
      if (in_features == 0) in_features = k;
      TORCH_CHECK(k == in_features, "GGUF parts of one projection must share in_features");
    });
    out_features += p.data.size(0);
  }
  TORCH_CHECK(!bias.defined() || bias.numel() == out_features, "bias must be [out_features]");
}

Tensor GGUFProjection::operator()(const Tensor& x_in) const {
  TORCH_CHECK(x_in.dim() == 2 && x_in.size(1) == in_features, "a GGUF projection takes [rows, ",
              in_features, "] inputs");
  TORCH_CHECK(x_in.scalar_type() == at::kFloat || x_in.scalar_type() == at::kBFloat16,
              "GGUF projections take float32 or bfloat16 inputs");
  const Tensor x = x_in.contiguous();
  const int64_t rows = x.size(0);
  if (rows > max_rows) return tiled(x, *this);
  Tensor y = at::empty({rows, out_features}, x.options());
  if (rows == 0) return y;
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "gguf_linear", [&] {
    Activations a = quantize<scalar_t>(x.data_ptr<scalar_t>(), rows, in_features);
#ifdef TIDAL_GGUF_AVX512
    a.d8.resize(a.d.size() * 8);
    for (size_t g = 0; g < a.d.size(); ++g) std::fill_n(&a.d8[g * 8], 8, a.d[g]);
#endif
    const Tensor b = bias.defined() ? bias.to(x.scalar_type()) : Tensor();
    int64_t col = 0;
    for (const GGUFPart& p : parts) {
      with_format(p.type, [&](auto format) {
        linear<decltype(format), scalar_t>(a, rows, in_features, p.data, p.planar,
                                           b.defined() ? b.data_ptr<scalar_t>() + col : nullptr,
                                           y.data_ptr<scalar_t>() + col, out_features);
      });
      col += p.data.size(0);
    }
  });
  return y;
}

Tensor gguf_linear(const Tensor& x, const Tensor& w, int64_t type, bool planar,
                   const Tensor& bias) {
  TORCH_CHECK(x.dim() == 2, "gguf_linear takes [rows, k] inputs");
  TORCH_CHECK(!bias.defined() || bias.scalar_type() == x.scalar_type(),
              "bias must be in x's dtype");
  const GGUFProjection g({GGUFPart{w, type, planar}}, bias, x.size(0), 1, false);
  return g(x);
}

void gguf_get_rows(const Tensor& w, int64_t type, bool planar, const Tensor& ids, Tensor out) {
  rows_into(GGUFPart{w, type, planar}, 0, ids.to(at::kLong).contiguous(), out);
}

}  // namespace tidal_cpu
