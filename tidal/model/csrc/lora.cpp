// Batched LoRA deltas: y[row] += (x[row] A_s^T) B_s^T for each listed row of slot s, both
// products in one call; B is given transposed ([S, R, n]) so the expand runs along rows. A
// fused projection's parts (q, k, v) have B block-diagonal: an output column multiplies
// only its part's ranks.
//
// Why: a step's adapter rows are few and the ranks small (a decode row of SmolLM2's qkv at
// rank 16 is ~70k multiply-adds), so ATen's gather, casts, two GEMMs and scatter cost more
// in dispatch than in arithmetic, 120 times a step. Here the rank-R intermediate stays in
// the call, and the tasks (a row's dot with one row of A; a row's 64 output columns of the
// expand, along B^T's rows) run in parallel.

#include "tidal_cpu.h"

namespace tidal_cpu {
namespace {

constexpr int64_t kColumns = 64;  // output columns an expand task computes

template <typename T>
void add_deltas(const T* x, T* y, const T* a, const T* b, const int64_t* rows,
                const std::vector<int64_t>& slot, int64_t m, int64_t k, int64_t n, int64_t r,
                const int64_t* bounds, int64_t parts) {
  std::vector<float> u(m * r);  // each row's x A^T
  at::parallel_for(0, m * r, 64, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t i = t / r, j = t % r;
      u[t] = dot(x + rows[i] * k, a + (slot[i] * r + j) * k, k);
    }
  });
  const int64_t chunks = (n + kColumns - 1) / kColumns;
  at::parallel_for(0, m * chunks, 4, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t i = t / chunks, c0 = (t % chunks) * kColumns;
      const int64_t width = std::min(n - c0, kColumns);
      const float* ui = u.data() + i * r;
      // a fused projection's part p (columns up to bounds[p]) has ranks [p r/P, (p+1) r/P)
      int64_t p = 0;
      while (bounds[p] <= c0) ++p;
      float acc[kColumns] = {0.f};
      for (int64_t lo = c0; lo < c0 + width; lo = bounds[p++]) {
        const int64_t hi = std::min(c0 + width, bounds[p]);
        for (int64_t j = p * r / parts; j < (p + 1) * r / parts; ++j) {  // u_j B^T[j]
          const T* bj = b + (slot[i] * r + j) * n;
          const float uj = ui[j];
          for (int64_t c = lo; c < hi; ++c) acc[c - c0] += uj * f32(bj[c]);
        }
      }
      T* yi = y + rows[i] * n + c0;
      for (int64_t c = 0; c < width; ++c) yi[c] = round_to<T>(f32(yi[c]) + acc[c]);
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
