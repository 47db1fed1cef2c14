// The shared-memory all-reduce of tensor-parallel ranks on one machine (ShmReduce in
// tidal_cpu.h): what the C++ decoder calls after each layer's o and down projections, and
// the Python side's sum wherever this extension is built.

#include "tidal_cpu.h"

#include <sched.h>

#include <chrono>
#include <string>

namespace tidal_cpu {
namespace {

constexpr int64_t kFlagBytes = 64;  // a rank's call number on a cache line of its own
constexpr int kSpins = 2000;        // busy polls before yielding the core

template <typename T>
void reduce_typed(const ShmReduce& g, T* y, int64_t n) {
  auto flag = [&](int64_t r) { return reinterpret_cast<int64_t*>(g.base + r * kFlagBytes); };
  float* const slots = reinterpret_cast<float*>(g.base + g.size * kFlagBytes);
  for (int64_t start = 0; start < std::max<int64_t>(n, 1); start += g.slot_floats) {
    const int64_t len = std::min(g.slot_floats, n - start);
    const int64_t call = __atomic_load_n(flag(g.rank), __ATOMIC_RELAXED) + 1;
    float* const set = slots + (call % 2) * g.size * g.slot_floats;
    float* const mine = set + g.rank * g.slot_floats;
    for (int64_t i = 0; i < len; ++i) mine[i] = f32(y[start + i]);
    __atomic_store_n(flag(g.rank), call, __ATOMIC_RELEASE);  // the slot is written
    const auto began = std::chrono::steady_clock::now();
    for (int64_t r = 0; r < g.size; ++r) {
      for (int spins = 0; __atomic_load_n(flag(r), __ATOMIC_ACQUIRE) < call; ++spins) {
        if (spins < kSpins) continue;
        sched_yield();
        const double waited = std::chrono::duration<double>(
            std::chrono::steady_clock::now() - began).count();
        TORCH_CHECK(waited <= g.timeout_s, "tensor-parallel rank ", r,
                    " did not reach all-reduce ", call, " in ", g.timeout_s, " s");
      }
    }
    at::parallel_for(0, len, 1 << 14, [&](int64_t lo, int64_t hi) {
      for (int64_t i = lo; i < hi; ++i) {
        float acc = set[i];  // rank 0's, then each rank's in order: the same bits everywhere
        for (int64_t r = 1; r < g.size; ++r) acc += set[r * g.slot_floats + i];
        y[start + i] = round_to<T>(acc);
      }
    });
  }
}

}  // namespace

void ShmReduce::operator()(Tensor& y) const {
  TORCH_CHECK(y.is_contiguous() && !y.is_cuda(), "the shared-memory sum takes contiguous CPU rows");
  if (y.scalar_type() == at::kFloat) {
    reduce_typed<float>(*this, y.data_ptr<float>(), y.numel());
  } else {
    TORCH_CHECK(y.scalar_type() == at::kBFloat16, "the shared-memory sum runs float32 and bf16");
    reduce_typed<BFloat16>(*this, reinterpret_cast<BFloat16*>(y.data_ptr()), y.numel());
  }
}

}  // namespace tidal_cpu
