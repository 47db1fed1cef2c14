// Batched LoRA deltas: y[row] += (x[row] A_s^T) B_s^T for each listed row of slot s, both
// products in one call; B is given transposed ([S, R, n]) so the expand runs along rows. A
// fused projection's parts (q, k, v) have B block-diagonal: an output column multiplies
// only its part's ranks.
//
// Why: a step's adapter rows are few and the ranks small (a decode row of SmolLM2's qkv at
// rank 16 is ~70k multiply-adds), so ATen's gather, casts, two GEMMs and scatter cost more
// in dispatch than in arithmetic, 120 times a step. Here the rank-R intermediate stays in
// the call, and the tasks (a row's dots with four rows of A; a row's 64 output columns of
// its part, along B^T's rows) run in parallel, with AVX-512 where the CPU has it.

#include "tidal_cpu.h"

#include <array>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define TIDAL_LORA_AVX512 1
#include <immintrin.h>
#endif

namespace tidal_cpu {
namespace {

constexpr int64_t kColumns = 64;  // output columns an expand task computes
constexpr int64_t kRanks = 4;     // rows of A a shrink task multiplies with one x row

#ifdef TIDAL_LORA_AVX512
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const BFloat16* p) {  // bf16 is float32's top half
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline __m512 load16(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 load16(const BFloat16* p, __mmask16 m) {
  const __m256i h = _mm256_maskz_loadu_epi16(m, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
#endif

// out[q] = x . a[q] over k for `count` (<= kRanks) rows of A: x (float32) read once.
template <typename T>
void dots(const float* x, const T* const* a, int count, int64_t k, float* out) {
  int64_t c = 0;
  float acc[kRanks] = {0.f};
#ifdef TIDAL_LORA_AVX512
  __m512 v[kRanks];
  for (int q = 0; q < kRanks; ++q) v[q] = _mm512_setzero_ps();
  for (; c + 16 <= k; c += 16) {
    const __m512 xv = _mm512_loadu_ps(x + c);
    for (int q = 0; q < count; ++q) v[q] = _mm512_fmadd_ps(load16(a[q] + c), xv, v[q]);
  }
  for (int q = 0; q < count; ++q) acc[q] = _mm512_reduce_add_ps(v[q]);
#endif
  for (int q = 0; q < count; ++q)
    acc[q] += c < k ? dot(x + c, a[q] + c, k - c) : 0.f;
  for (int q = 0; q < count; ++q) out[q] = acc[q];
}

// y[0:w] += sum over j in [j0, j1) of u[j] * bt[j * n : j * n + w], w <= kColumns.
template <typename T>
void expand(const float* u, const T* bt, int64_t n, int64_t j0, int64_t j1, int64_t w, T* y) {
  float acc[kColumns];
#ifdef TIDAL_LORA_AVX512
  __m512 v[kColumns / 16];
  for (auto& x : v) x = _mm512_setzero_ps();
  const int64_t full = w / 16;
  const __mmask16 tail = static_cast<__mmask16>((1u << (w % 16)) - 1);
  for (int64_t j = j0; j < j1; ++j) {
    const __m512 uj = _mm512_set1_ps(u[j]);
    const T* bj = bt + j * n;
    for (int64_t q = 0; q < full; ++q) v[q] = _mm512_fmadd_ps(uj, load16(bj + 16 * q), v[q]);
    if (tail) v[full] = _mm512_fmadd_ps(uj, load16(bj + 16 * full, tail), v[full]);
  }
  for (int64_t q = 0; q < kColumns / 16; ++q) _mm512_storeu_ps(acc + 16 * q, v[q]);
#else
  for (int64_t c = 0; c < w; ++c) acc[c] = 0.f;
  for (int64_t j = j0; j < j1; ++j)
    for (int64_t c = 0; c < w; ++c) acc[c] += u[j] * f32(bt[j * n + c]);
#endif
  for (int64_t c = 0; c < w; ++c) y[c] = round_to<T>(f32(y[c]) + acc[c]);
}

template <typename T>
void add_deltas(const T* x, T* y, const T* a, const T* b, const int64_t* rows,
                const std::vector<int64_t>& slot, int64_t m, int64_t k, int64_t n, int64_t r,
                const int64_t* bounds, int64_t parts) {
  // the listed rows in float32 and their x A^T: buffers kept across calls (a fresh one of
  // this size is mmap'd, and its pages faulted in, on every call)
  // (thread_local: the lambdas below run on other threads, so they take the pointers)
  static thread_local std::vector<float> xf_buf, u_buf;
  xf_buf.resize(m * k);
  u_buf.resize(m * r);
  float* const xf = xf_buf.data();
  float* const u = u_buf.data();
  at::parallel_for(0, m, 4, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i)
      for (int64_t c = 0; c < k; ++c) xf[i * k + c] = f32(x[rows[i] * k + c]);
  });
  const int64_t groups = (r + kRanks - 1) / kRanks;
  at::parallel_for(0, m * groups, 8, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t i = t / groups, j0 = (t % groups) * kRanks;
      const int count = static_cast<int>(std::min(kRanks, r - j0));
      const T* rows_a[kRanks];
      for (int q = 0; q < count; ++q) rows_a[q] = a + (slot[i] * r + j0 + q) * k;
      dots(xf + i * k, rows_a, count, k, u + i * r + j0);
    }
  });
  // the expand's column chunks, none across a part boundary: (part, first column, width)
  std::vector<std::array<int64_t, 3>> chunks;
  for (int64_t p = 0, c0 = 0; p < parts; c0 = bounds[p++])
    for (int64_t c = c0; c < bounds[p]; c += kColumns)
      chunks.push_back({p, c, std::min(kColumns, bounds[p] - c)});
  const int64_t nc = static_cast<int64_t>(chunks.size()), per = r / parts;
  at::parallel_for(0, m * nc, 4, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t i = t / nc;
      const auto& [p, c0, w] = chunks[t % nc];
      expand(u + i * r, b + slot[i] * r * n + c0, n, p * per, (p + 1) * per, w,
             y + rows[i] * n + c0);
    }
  });
}

}  // namespace

void lora_add(const Tensor& x, Tensor& y, const Tensor& a, const Tensor& b, const Tensor& rows,
              const Tensor& ends, const Tensor& bounds) {
  TORCH_CHECK(x.dim() == 2 && y.dim() == 2 && a.dim() == 3 && b.dim() == 3 &&
                  x.is_contiguous() && y.is_contiguous() && a.is_contiguous() &&
                  b.is_contiguous(),
              "lora_add takes contiguous x [rows, k], y [rows, n], A [S, R, k], B^T [S, R, n]");
  TORCH_CHECK(x.scalar_type() == y.scalar_type() && a.scalar_type() == x.scalar_type() &&
                  b.scalar_type() == x.scalar_type() &&
                  (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "lora_add runs float32 or bfloat16, one dtype for all");
  const int64_t k = x.size(1), n = y.size(1), r = a.size(1), slots = a.size(0);
  TORCH_CHECK(a.size(2) == k && b.size(1) == r && b.size(2) == n && b.size(0) == slots &&
                  x.size(0) == y.size(0),
              "lora_add: shapes do not agree");
  const Tensor rows_l = rows.to(at::kLong).contiguous(), ends_l = ends.to(at::kLong).contiguous();
  TORCH_CHECK(ends_l.numel() == slots, "ends needs one entry per slot");
  const Tensor bounds_l = bounds.to(at::kLong).contiguous();
  const int64_t parts = bounds_l.numel();
  TORCH_CHECK(parts >= 1 && r % parts == 0 && bounds_l.data_ptr<int64_t>()[parts - 1] == n,
              "bounds: the parts' cumulative output counts, ending at n, each part r/P ranks");
  const int64_t m = rows_l.numel();
  const int64_t* end = ends_l.data_ptr<int64_t>();
  const int64_t* row = rows_l.data_ptr<int64_t>();
  std::vector<int64_t> slot(m);
  for (int64_t s = 0, i = 0; s < slots; ++s) {
    TORCH_CHECK(end[s] >= i && end[s] <= m, "ends must be cumulative row counts");
    for (; i < end[s]; ++i) slot[i] = s;
  }
  TORCH_CHECK(slots == 0 || end[slots - 1] == m, "ends must end at the row count");
  for (int64_t i = 0; i < m; ++i)
    TORCH_CHECK(row[i] >= 0 && row[i] < x.size(0), "row ", row[i], " is not in x");
  if (x.scalar_type() == at::kFloat)
    add_deltas(x.data_ptr<float>(), y.data_ptr<float>(), a.data_ptr<float>(),
               b.data_ptr<float>(), row, slot, m, k, n, r,
               bounds_l.data_ptr<int64_t>(), parts);
  else
    add_deltas(x.data_ptr<BFloat16>(), y.data_ptr<BFloat16>(), a.data_ptr<BFloat16>(),
               b.data_ptr<BFloat16>(), row, slot, m, k, n, r,
               bounds_l.data_ptr<int64_t>(), parts);
}

}  // namespace tidal_cpu
