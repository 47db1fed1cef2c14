// Batched LoRA deltas: y[row] += (x[row] A_s^T) B_s^T for each listed row of slot s, both
// products in one call; B is given transposed ([S, R, n]) so the expand runs along rows. A
// fused projection's parts (q, k, v) have B block-diagonal: an output column multiplies
// only its part's ranks.
//
// Why: a step's adapter rows are few and the ranks small (a decode row of SmolLM2's qkv at
// rank 16 is ~70k multiply-adds), so ATen's gather, casts, two GEMMs and scatter cost more
// in dispatch than in arithmetic, 120 times a step. Here the rank-R intermediate stays in
// the call, and a slot's rows go in blocks of up to four: a task reads four rows of A, or
// 64 columns of B^T, once for the block (the slots' weights, not the rows, are what a
// decode step of many adapters streams from memory). AVX-512 where the CPU has it.
// The weights may be bfloat16 under float32 rows (half the bytes to stream).

#include "tidal_cpu.h"

#include <array>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define TIDAL_LORA_AVX512 1
#include <immintrin.h>
#endif

namespace tidal_cpu {
namespace {

constexpr int64_t kColumns = 64;  // output columns an expand task computes
constexpr int kRanks = 4;         // rows of A a shrink task multiplies with its rows
constexpr int kBlock = 4;         // rows of one slot a task takes together

struct Block {
  int64_t slot, first, count;  // listed rows [first, first + count), all of slot `slot`
};

#ifdef TIDAL_LORA_AVX512
inline __m512 load16(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 load16(const BFloat16* p, __mmask16 m) {  // bf16 is float32's top half
  const __m256i h = _mm256_maskz_loadu_epi16(m, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline __mmask16 first_n(int64_t n) {
  return n >= 16 ? __mmask16(0xffff) : n <= 0 ? __mmask16(0) : __mmask16((1u << n) - 1);
}
#endif

// out[i][q] = x[i] . a[q] over k, for NX rows of x (float32, `k` apart) and kRanks rows of A;
// `next`, the rows of A the following call reads, are fetched into cache meanwhile (the
// hardware prefetcher alone leaves a cold slot's loads waiting on memory).
template <int NX, typename W>
void shrink(const float* x, const W* const* a, const W* const* next, int64_t k,
            float (*out)[kRanks]) {
#ifdef TIDAL_LORA_AVX512
  __m512 acc[NX][kRanks];
  for (auto& row : acc)
    for (auto& v : row) v = _mm512_setzero_ps();
  for (int64_t c = 0; c < k; c += 16) {
    const __mmask16 m = first_n(k - c);
    __m512 av[kRanks];
    for (int q = 0; q < kRanks; ++q) av[q] = load16(a[q] + c, m);
    for (int q = 0; q < kRanks; ++q) _mm_prefetch(next[q] + c, _MM_HINT_T0);
    for (int i = 0; i < NX; ++i) {
      const __m512 xv = _mm512_maskz_loadu_ps(m, x + i * k + c);
      for (int q = 0; q < kRanks; ++q) acc[i][q] = _mm512_fmadd_ps(av[q], xv, acc[i][q]);
    }
  }
  for (int i = 0; i < NX; ++i)
    for (int q = 0; q < kRanks; ++q) out[i][q] = _mm512_reduce_add_ps(acc[i][q]);
#else
  for (int i = 0; i < NX; ++i)
    for (int q = 0; q < kRanks; ++q) out[i][q] = dot(x + i * k, a[q], k);
#endif
}

// y[i][0:w] += sum over j in [j0, j1) of u[i * r + j] * bt[j * n : j * n + w], for NX rows,
// w <= kColumns; the `ahead` columns after them are fetched into cache meanwhile.
template <int NX, typename W, typename T>
void expand(const float* u, int64_t r, const W* bt, int64_t n, int64_t j0, int64_t j1,
            int64_t w, int64_t ahead, T* const* y) {
  float acc[NX][kColumns];
#ifdef TIDAL_LORA_AVX512
  constexpr int kVecs = kColumns / 16;
  __mmask16 m[kVecs];
  for (int q = 0; q < kVecs; ++q) m[q] = first_n(w - 16 * q);
  __m512 v[NX][kVecs];
  for (auto& row : v)
    for (auto& x : row) x = _mm512_setzero_ps();
  for (int64_t j = j0; j < j1; ++j) {
    __m512 bv[kVecs];
    for (int q = 0; q < kVecs; ++q) bv[q] = load16(bt + j * n + 16 * q, m[q]);
    for (int64_t c = kColumns; c < kColumns + ahead; c += 16) _mm_prefetch(bt + j * n + c, _MM_HINT_T0);
    for (int i = 0; i < NX; ++i) {
      const __m512 uj = _mm512_set1_ps(u[i * r + j]);
      for (int q = 0; q < kVecs; ++q) v[i][q] = _mm512_fmadd_ps(uj, bv[q], v[i][q]);
    }
  }
  for (int i = 0; i < NX; ++i)
    for (int q = 0; q < kVecs; ++q) _mm512_storeu_ps(acc[i] + 16 * q, v[i][q]);
#else
  for (int i = 0; i < NX; ++i) {
    for (int64_t c = 0; c < w; ++c) acc[i][c] = 0.f;
    for (int64_t j = j0; j < j1; ++j)
      for (int64_t c = 0; c < w; ++c) acc[i][c] += u[i * r + j] * f32(bt[j * n + c]);
  }
#endif
  for (int i = 0; i < NX; ++i)
    for (int64_t c = 0; c < w; ++c) y[i][c] = round_to<T>(f32(y[i][c]) + acc[i][c]);
}

// f.template operator()<N>() for N = count in [1, kBlock]: the row count as a constant, so
// the accumulators stay in registers.
template <typename F>
void by_rows(int64_t count, F&& f) {
  switch (count) {
    case 1: return f.template operator()<1>();
    case 2: return f.template operator()<2>();
    case 3: return f.template operator()<3>();
    default: return f.template operator()<4>();
  }
}

template <typename T, typename W>
void add_deltas(const T* x, T* y, const W* a, const W* b, const int64_t* rows,
                const std::vector<Block>& blocks, int64_t k, int64_t n, int64_t r,
                const int64_t* bounds, int64_t parts) {
  // the expand's column chunks, none across a part boundary: (part, first column, width)
  std::vector<std::array<int64_t, 3>> chunks;
  for (int64_t p = 0, c0 = 0; p < parts; c0 = bounds[p++])
    for (int64_t c = c0; c < bounds[p]; c += kColumns)
      chunks.push_back({p, c, std::min(kColumns, bounds[p] - c)});
  const int64_t per = r / parts;
  // one task per block, shrink then expand: one fork-join a call, and a slot's weights
  // streamed by one thread while the other streams another slot's
  at::parallel_for(0, static_cast<int64_t>(blocks.size()), 1, [&](int64_t b0, int64_t b1) {
    // the block's rows in float32 and their x A^T, kept across calls (thread_local: a fresh
    // buffer of this size is mmap'd, and its pages faulted in, on every call)
    static thread_local std::vector<float> xf_buf, u_buf;
    xf_buf.resize(kBlock * k);
    u_buf.resize(kBlock * r);
    float* const xf = xf_buf.data();
    float* const u = u_buf.data();
    for (int64_t t = b0; t < b1; ++t) {
      const Block& blk = blocks[t];
      for (int64_t i = 0; i < blk.count; ++i)
        for (int64_t c = 0; c < k; ++c) xf[i * k + c] = f32(x[rows[blk.first + i] * k + c]);
      for (int64_t j0 = 0; j0 < r; j0 += kRanks) {
        const int64_t count = std::min<int64_t>(kRanks, r - j0);
        const W* rows_a[kRanks];
        const W* next_a[kRanks];
        for (int q = 0; q < kRanks; ++q) {  // past r: repeat the last row, its dots unused
          rows_a[q] = a + (blk.slot * r + j0 + std::min<int64_t>(q, count - 1)) * k;
          next_a[q] = a + (blk.slot * r + std::min<int64_t>(j0 + kRanks + q, r - 1)) * k;
        }
        float out[kBlock][kRanks];
        by_rows(blk.count, [&]<int NX>() { shrink<NX>(xf, rows_a, next_a, k, out); });
        for (int64_t i = 0; i < blk.count; ++i)
          for (int64_t q = 0; q < count; ++q) u[i * r + j0 + q] = out[i][q];
      }
      for (size_t h = 0; h < chunks.size(); ++h) {
        const auto& [p, c0, w] = chunks[h];
        // the next chunk of the same part, if any (another part's ranks are other rows)
        const int64_t ahead =
            h + 1 < chunks.size() && chunks[h + 1][0] == p ? chunks[h + 1][2] : 0;
        T* ys[kBlock];
        for (int64_t i = 0; i < blk.count; ++i) ys[i] = y + rows[blk.first + i] * n + c0;
        by_rows(blk.count, [&]<int NX>() {
          expand<NX>(u, r, b + blk.slot * r * n + c0, n, p * per, (p + 1) * per, w, ahead, ys);
        });
      }
    }
  });
}

template <typename T>
void add_deltas_as(const Tensor& x, Tensor& y, const Tensor& a, const Tensor& b,
                   const int64_t* rows, const std::vector<Block>& blocks,
                   const int64_t* bounds, int64_t parts) {
  const int64_t k = x.size(1), n = y.size(1), r = a.size(1);
  if (a.scalar_type() == at::kFloat)
    add_deltas(x.data_ptr<T>(), y.data_ptr<T>(), a.data_ptr<float>(), b.data_ptr<float>(),
               rows, blocks, k, n, r, bounds, parts);
  else
    add_deltas(x.data_ptr<T>(), y.data_ptr<T>(), a.data_ptr<BFloat16>(),
               b.data_ptr<BFloat16>(), rows, blocks, k, n, r, bounds, parts);
}

bool float_or_bf16(const Tensor& t) {
  return t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16;
}

}  // namespace

void lora_add(const Tensor& x, Tensor& y, const Tensor& a, const Tensor& b, const Tensor& rows,
              const Tensor& ends, const Tensor& bounds) {
  TORCH_CHECK(x.dim() == 2 && y.dim() == 2 && a.dim() == 3 && b.dim() == 3 &&
                  x.is_contiguous() && y.is_contiguous() && a.is_contiguous() &&
                  b.is_contiguous(),
              "lora_add takes contiguous x [rows, k], y [rows, n], A [S, R, k], B^T [S, R, n]");
  TORCH_CHECK(x.scalar_type() == y.scalar_type() && a.scalar_type() == b.scalar_type() &&
                  float_or_bf16(x) && float_or_bf16(a),
              "lora_add runs float32 or bfloat16: x and y of one dtype, A and B of one");
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
  std::vector<Block> blocks;
  for (int64_t s = 0, i = 0; s < slots; ++s) {
    TORCH_CHECK(end[s] >= i && end[s] <= m, "ends must be cumulative row counts");
    for (; i < end[s]; i += kBlock) blocks.push_back({s, i, std::min<int64_t>(kBlock, end[s] - i)});
    i = end[s];
  }
  TORCH_CHECK(slots == 0 || end[slots - 1] == m, "ends must end at the row count");
  for (int64_t i = 0; i < m; ++i)
    TORCH_CHECK(row[i] >= 0 && row[i] < x.size(0), "row ", row[i], " is not in x");
  if (x.scalar_type() == at::kFloat)
    add_deltas_as<float>(x, y, a, b, row, blocks, bounds_l.data_ptr<int64_t>(), parts);
  else
    add_deltas_as<BFloat16>(x, y, a, b, row, blocks, bounds_l.data_ptr<int64_t>(), parts);
}

}  // namespace tidal_cpu
