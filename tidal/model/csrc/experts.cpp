// Routed experts at decode sizes: every expert's projection over its few rows in one call.
//
// A decode step of 32 tokens over 8 experts (top 2) gives each expert ~8 rows; a GEMM call
// per expert then costs more in its fixed overhead (and in packing the weight) than in its
// arithmetic. Here one parallel loop covers every (expert, 16-column panel) pair: a panel's
// weights, stored contiguously ([E, n/16, k, 16]: each task streams one block), are read
// once for up to 6 of its expert's rows at a time, into 12 AVX2 accumulators.

#include "tidal_cpu.h"

#ifdef __AVX2__
#include <immintrin.h>
#endif

namespace tidal_cpu {
namespace {

constexpr int64_t kPanel = 16;  // output columns a task computes (two AVX2 registers)
constexpr int kMaxRows = 6;     // rows sharing each weight load

#ifdef __AVX2__
// Eight weights as float32: loaded, or widened from bf16 (its bits are float32's top half).
inline __m256 load8(const float* w) { return _mm256_loadu_ps(w); }
inline __m256 load8(const BFloat16* w) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
#endif

// y[r, c0:c0+16] for NR rows starting at x (row stride k, y row stride n); w is the panel's
// [k, 16] block of weights (float32, or bf16: half the bytes, which bound a decode step).
template <int NR, typename W>
void panel_rows(const float* x, const W* w, float* y, int64_t k, int64_t n, int64_t c0) {
#ifdef __AVX2__
  __m256 lo[NR], hi[NR];
  for (int r = 0; r < NR; ++r) lo[r] = hi[r] = _mm256_setzero_ps();
  for (int64_t i = 0; i < k; ++i) {
    const W* wi = w + i * kPanel;
    const __m256 a = load8(wi), b = load8(wi + 8);
    for (int r = 0; r < NR; ++r) {
      const __m256 xv = _mm256_broadcast_ss(x + r * k + i);
      lo[r] = _mm256_fmadd_ps(xv, a, lo[r]);
      hi[r] = _mm256_fmadd_ps(xv, b, hi[r]);
    }
  }
  for (int r = 0; r < NR; ++r) {
    _mm256_storeu_ps(y + r * n + c0, lo[r]);
    _mm256_storeu_ps(y + r * n + c0 + 8, hi[r]);
  }
#else
  float acc[NR][kPanel] = {};
  for (int64_t i = 0; i < k; ++i)
    for (int r = 0; r < NR; ++r)
      for (int j = 0; j < kPanel; ++j) acc[r][j] += x[r * k + i] * f32(w[i * kPanel + j]);
  for (int r = 0; r < NR; ++r)
    for (int j = 0; j < kPanel; ++j) y[r * n + c0 + j] = acc[r][j];
#endif
}

template <typename W>
void grouped_rows(const float* x, const int64_t* end, const W* wp, float* yp, int64_t experts,
                  int64_t panels, int64_t k) {
  const int64_t n = panels * kPanel;
  // one task per (expert, panel); idle experts' tasks return at once
  at::parallel_for(0, experts * panels, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t e = t / panels, c0 = (t % panels) * kPanel;
      const int64_t first = e == 0 ? 0 : end[e - 1], count = end[e] - first;
      const W* we = wp + t * k * kPanel;  // task t is panel t % panels of expert e
      for (int64_t r = 0; r < count; r += kMaxRows) {
        const float* xr = x + (first + r) * k;
        float* yr = yp + (first + r) * n;
        switch (std::min<int64_t>(kMaxRows, count - r)) {
          case 1: panel_rows<1>(xr, we, yr, k, n, c0); break;
          case 2: panel_rows<2>(xr, we, yr, k, n, c0); break;
          case 3: panel_rows<3>(xr, we, yr, k, n, c0); break;
          case 4: panel_rows<4>(xr, we, yr, k, n, c0); break;
          case 5: panel_rows<5>(xr, we, yr, k, n, c0); break;
          default: panel_rows<6>(xr, we, yr, k, n, c0); break;
        }
      }
    }
  });
}

}  // namespace

// y = per expert e, xs[ends[e-1]:ends[e]] @ W[e]: xs [rows, k] float32 grouped by expert,
// ends [E] int32 (cumulative row counts, as torch._grouped_mm's offs), W [E, k, n] given as
// panels: w [E, n/16, k, 16] float32 or bf16 (pack_panels in mlp.py); y float32.
Tensor grouped_linear(const Tensor& xs_in, const Tensor& ends_in, const Tensor& w_in) {
  TORCH_CHECK(xs_in.dim() == 2 && w_in.dim() == 4 && xs_in.size(1) == w_in.size(2) &&
                  w_in.size(3) == kPanel,
              "grouped_linear takes xs [rows, k] and w [experts, n/16, k, 16]");
  TORCH_CHECK(xs_in.scalar_type() == at::kFloat &&
                  (w_in.scalar_type() == at::kFloat || w_in.scalar_type() == at::kBFloat16),
              "grouped_linear takes float32 rows and float32 or bf16 weights");
  const Tensor xs = xs_in.contiguous(), w = w_in.contiguous();
  const Tensor ends = ends_in.to(at::kLong).contiguous();
  const int64_t experts = w.size(0), panels = w.size(1), k = w.size(2), rows = xs.size(0);
  TORCH_CHECK(ends.numel() == experts, "ends needs one entry per expert");
  const int64_t* end = ends.data_ptr<int64_t>();
  TORCH_CHECK(experts == 0 || end[experts - 1] == rows, "ends must end at the row count");
  Tensor y = at::empty({rows, panels * kPanel}, xs.options());
  if (w.scalar_type() == at::kBFloat16)
    grouped_rows(xs.data_ptr<float>(), end, w.data_ptr<BFloat16>(), y.data_ptr<float>(),
                 experts, panels, k);
  else
    grouped_rows(xs.data_ptr<float>(), end, w.data_ptr<float>(), y.data_ptr<float>(), experts,
                 panels, k);
  return y;
}

}  // namespace tidal_cpu
