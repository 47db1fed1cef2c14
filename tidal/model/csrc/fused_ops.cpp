// The PyTorch path's fused ops on CPU (tidal.model.kernels.cpu_fused_kernels): the steps the
// C++ decoder does not take (prompts, mixed steps) run their norms, residual adds, RoPE,
// KV writes and SiLU * up through the decoder's own loops instead of chains of eager ops,
// each of which streams a step's whole [tokens, width] activations through memory. They
// take the Triton kernels' arguments (tidal/model/kernels/norm.py, rope_cache.py) and round
// as the eager ops do (bf16 after each op; float32 differs only in the RMSNorm sum's order).

#include "elementwise.h"
#include "kv_rows.h"

namespace tidal_cpu {
namespace {

// f.template operator()<T>() with T the element type of a float32 or bf16 tensor.
template <typename F>
auto with_model_type(const Tensor& x, F&& f) {
  TORCH_CHECK_VALUE(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
                    "the fused CPU ops run float32 and bfloat16 tensors");
  if (x.scalar_type() == at::kFloat) return f.template operator()<float>();
  return f.template operator()<BFloat16>();
}

// RMSNorm of x, or with `residual` of x + residual (x of residual's dtype, or bf16 products
// under a float32 residual): (normed, sum) in the residual's dtype.
std::tuple<Tensor, Tensor> norm(const Tensor& x, const Tensor& residual, const Tensor& weight,
                                double eps) {
  const int64_t hidden = x.size(-1);
  const Tensor& stream = residual.defined() ? residual : x;  // of the model's dtype
  TORCH_CHECK_VALUE(weight.dim() == 1 && weight.size(0) == hidden &&
                        weight.scalar_type() == stream.scalar_type(),
                    "RMSNorm weight must be [", hidden, "] of the rows' dtype");
  TORCH_CHECK_VALUE(!residual.defined() ||
                        (residual.sizes() == x.sizes() &&
                         (x.scalar_type() == residual.scalar_type() ||
                          (x.scalar_type() == at::kBFloat16 &&
                           residual.scalar_type() == at::kFloat))),
                    "the residual does not match x's shape and dtype");
  const Tensor xc = x.contiguous(), w = weight.contiguous();
  const Tensor rc = residual.defined() ? residual.contiguous() : Tensor();
  Tensor out = at::empty_like(stream, at::MemoryFormat::Contiguous);
  Tensor sum = residual.defined() ? at::empty_like(out) : Tensor();
  const int64_t rows = hidden == 0 ? 0 : xc.numel() / hidden;
  const float e = static_cast<float>(eps);
  with_model_type(stream, [&]<typename T>() {
    if (!rc.defined()) {  // the norm of x itself (sum is x, unwritten)
      T* x_itself = const_cast<T*>(xc.data_ptr<T>());
      add_rms_norm<T>(x_itself, static_cast<const T*>(nullptr), x_itself, w.data_ptr<T>(),
                      out.data_ptr<T>(), rows, hidden, e);
      return;
    }
    with_model_type(xc, [&]<typename Y>() {  // residual + x, as x + residual rounds
      add_rms_norm<T, Y>(rc.data_ptr<T>(), xc.data_ptr<Y>(), sum.data_ptr<T>(),
                         w.data_ptr<T>(), out.data_ptr<T>(), rows, hidden, e);
    });
  });
  return {out, sum};
}

// [rows, heads, d] with each head's d values adjacent and heads d apart (rows may be apart).
bool head_rows(const Tensor& t) {
  return t.dim() == 3 && t.stride(2) == 1 && t.stride(1) == t.size(2);
}

}  // namespace

Tensor rms_norm(const Tensor& x, const Tensor& weight, double eps) {
  return std::get<0>(norm(x, Tensor(), weight, eps));
}

std::tuple<Tensor, Tensor> fused_add_rms_norm(const Tensor& x, const Tensor& residual,
                                              const Tensor& weight, double eps) {
  TORCH_CHECK_VALUE(residual.defined(), "fused_add_rms_norm needs a residual");
  return norm(x, residual, weight, eps);
}

std::tuple<Tensor, Tensor> rope_and_cache(Tensor qk, Tensor v, Tensor cos, Tensor sin,
                                          const Tensor& k_cache, const Tensor& v_cache,
                                          Tensor slots, int64_t num_q_heads) {
  TORCH_CHECK_VALUE(qk.dim() == 3 && v.dim() == 3, "qk [T, H + Hkv, D] and v [T, Hkv, D]");
  const int64_t tokens = qk.size(0), d = qk.size(2), hkv = qk.size(1) - num_q_heads;
  TORCH_CHECK_VALUE(num_q_heads > 0 && hkv > 0 && v.size(0) == tokens && v.size(1) == hkv &&
                        v.size(2) == d && v.scalar_type() == qk.scalar_type() &&
                        k_cache.dim() == 4 && k_cache.size(2) == hkv &&
                        v_cache.sizes() == k_cache.sizes() &&
                        v_cache.scalar_type() == k_cache.scalar_type(),
                    "qk ", qk.sizes(), " with ", num_q_heads, " q heads and v ", v.sizes(),
                    " do not match the caches ", k_cache.sizes());
  check_cache(k_cache, qk.scalar_type(), d);
  const int64_t rd = cos.size(-1);
  TORCH_CHECK_VALUE(
      rd % 2 == 0 && rd <= d && cos.numel() == tokens * rd && sin.sizes() == cos.sizes(),
      "RoPE tables of ", rd, " dims for ", tokens, " tokens of heads of ", d);
  if (!head_rows(qk)) qk = qk.contiguous();  // rotated in place: qk is the projection's own
  if (!head_rows(v)) v = v.contiguous();
  cos = cos.reshape({tokens, rd}).to(at::kFloat).contiguous();
  sin = sin.reshape({tokens, rd}).to(at::kFloat).contiguous();
  slots = slots.to(at::kLong).contiguous();
  check_slots(slots, tokens, k_cache.size(0) * k_cache.size(1), -1);
  const int64_t* slot = slots.data_ptr<int64_t>();
  with_model_type(qk, [&]<typename T>() {
    T* x = qk.data_ptr<T>();
    rope<T>(x, qk.stride(0), cos.data_ptr<float>(), sin.data_ptr<float>(), tokens,
            num_q_heads + hkv, d, rd);
    with_cache_type<T>(k_cache.scalar_type(), [&]<typename C>() {
      at::parallel_for(0, tokens, 64, [&](int64_t t0, int64_t t1) {
        write_kv<T, C>(x + t0 * qk.stride(0), qk.stride(0), num_q_heads * d, slot + t0,
                       t1 - t0, hkv, d, k_cache.data_ptr<C>());
        write_kv<T, C>(v.data_ptr<T>() + t0 * v.stride(0), v.stride(0), 0, slot + t0, t1 - t0,
                       hkv, d, v_cache.data_ptr<C>());
      });
    });
  });
  return {qk.narrow(1, 0, num_q_heads), qk.narrow(1, num_q_heads, hkv)};
}

Tensor silu_mul(const Tensor& gate_up, at::ScalarType dtype) {
  TORCH_CHECK_VALUE(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0 && gate_up.stride(1) == 1,
                    "gate_up must be [rows, 2 * intermediate] with unit column stride");
  const int64_t rows = gate_up.size(0), inter = gate_up.size(1) / 2;
  Tensor act = at::empty({rows, inter}, gate_up.options().dtype(dtype));
  constexpr int64_t kBlock = 16;  // rows a SiLU call takes: its output stays in cache
  // Rows kept apart, as the eager gate's are: ATen then vectorises each row alone, and a
  // row's tail takes its scalar exp at the same elements.
  const int64_t stride = inter + 16;
  with_model_type(act, [&]<typename T>() {
    with_model_type(gate_up, [&]<typename G>() {
      at::parallel_for(0, rows, kBlock, [&](int64_t r0, int64_t r1) {
        Tensor silu = at::empty({kBlock, stride}, act.options()).narrow(1, 0, inter);
        for (int64_t b = r0; b < r1; b += kBlock) {
          const int64_t n = std::min(kBlock, r1 - b);
          Tensor s = silu.narrow(0, 0, n);
          s.copy_(gate_up.narrow(0, b, n).narrow(1, 0, inter));
          at::silu_(s);  // ATen's, as the eager path's F.silu rounds
          const T* sp = s.data_ptr<T>();
          for (int64_t r = 0; r < n; ++r) {
            const G* up = gate_up.data_ptr<G>() + (b + r) * gate_up.stride(0) + inter;
            T* out = act.data_ptr<T>() + (b + r) * inter;
            for (int64_t i = 0; i < inter; ++i)
              out[i] = round_to<T>(f32(sp[r * stride + i]) * f32(up[i]));
          }
        }
      });
    });
  });
  return act;
}

}  // namespace tidal_cpu
