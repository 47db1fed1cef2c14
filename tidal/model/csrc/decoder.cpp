// tidal's CPU decode path: a whole decode-only step of a Llama-family model in one call.
//
// Why: on CPU a small model's decode step is bound by per-op dispatch, not by arithmetic
// (SmolLM2-135M runs ~60 eager PyTorch ops a layer at 3-5 us each). Here the projections
// stay ATen calls (int4 / oneDNN kernels, multi-threaded) and everything between them --
// RMSNorm + residual, RoPE, the KV write, paged attention, SiLU * up -- is plain loops.
// Rounding follows the PyTorch path op for op (bf16 after every op it rounds at), and that
// path calls the same attention kernel, so only the RMSNorm sum's order differs (the tests
// find the two bit-identical). Attention reads the paged cache in place: no gather.
//
// This file holds the decoder (the layer loop; its elementwise loops are elementwise.h) and
// the Python bindings.

#include <torch/extension.h>

#include <functional>

#include "elementwise.h"
#include "kv_rows.h"

namespace tidal_cpu {

// ---------------------------------------------------------------- the decoder

struct Layer {
  Tensor norm1, norm2;
  Linear qkv, o, gate_up, down;
  int64_t window;  // sliding window (0: full attention)
  bool rope;  // rotates q and k (SmolLM3's layers without RoPE do not)
  std::vector<Tensor> lora;  // LoRA slots: A, B^T and part bounds of qkv, o, gate_up, down
};


class Decoder {
 public:
  // `embed`: the embedding table in the model's dtype, or undefined with `embed_gguf`, a
  // GGUF table whose rows a step dequantizes. The model's dtype is the final norm's.
  Decoder(Tensor embed, GGUFPart embed_gguf, Tensor final_norm, Linear lm_head, Tensor cos,
          Tensor sin, int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t intermediate,
          double eps)
      : embed_(embed), embed_gguf_(embed_gguf), final_norm_(final_norm), lm_head_(lm_head),
        cos_(cos.contiguous()), sin_(sin.contiguous()), heads_(heads), hkv_(kv_heads),
        d_(head_dim), inter_(intermediate), eps_(static_cast<float>(eps)) {
    const auto dtype = final_norm.scalar_type();
    TORCH_CHECK(dtype == at::kBFloat16 || dtype == at::kFloat,
                "the CPU decoder runs bfloat16 and float32 models");
    TORCH_CHECK(embed.defined() ? embed.scalar_type() == dtype : embed_gguf.data.defined(),
                "the embedding must be in the final norm's dtype, or a GGUF table");
    TORCH_CHECK(heads % kv_heads == 0, "heads must be a multiple of kv heads");
    TORCH_CHECK(cos.dim() == 2 && cos.sizes() == sin.sizes() && cos.size(1) % 2 == 0 &&
                    cos.size(1) <= head_dim && cos.scalar_type() == at::kFloat,
                "RoPE tables must be float32 [positions, rotary_dim <= head_dim], rotary_dim even");
  }

  void add_layer(Tensor norm1, Tensor norm2, Linear qkv, Linear o, Linear gate_up, Linear down,
                 int64_t window, bool rope) {
    layers_.push_back({norm1, norm2, qkv, o, gate_up, down, window, rope, {}});
  }

  // One rank of a tensor-parallel group: each layer's o and down projections hold its
  // columns, and their outputs are summed over the ranks before the residual add; the
  // embedding holds the vocabulary's rows from `vocab_start` (the others' tokens look up
  // zeros, then a sum), and the logits returned are those of its rows (gathered by Python).
  // `reduce` sums y over the ranks in place: the shared segment's on one machine, or a
  // Python callable (torch.distributed's gloo) where the ranks span machines.
  void set_all_reduce(std::function<void(Tensor&)> reduce, int64_t vocab_start) {
    reduce_ = std::move(reduce);
    vocab_start_ = vocab_start;
  }

  // A pipeline stage's decoder (its layers alone): without `embeds` a step's `ids` are the
  // previous stage's hidden states [rows, hidden] in the model's dtype; a step returns the
  // residual stream after its last layer, or with `ends` the final normed states of the
  // logits rows (every stage's LM head is Python's).
  void set_stage(bool embeds, bool ends) {
    stage_ = true;
    embeds_ = embeds;
    ends_ = ends;
  }

  // Batch-invariant inference: each row attends through the paged prefill kernel, as a
  // run of one token (the PyTorch path's every row does the same; no trees).
  void set_batch_invariant(bool on) { batch_invariant_ = on; }

  // Layer `layer`'s LoRA slot weights (shared with Python, which writes adapters into them).
  void set_lora(int64_t layer, std::vector<Tensor> weights) {
    TORCH_CHECK(weights.size() == 12, "LoRA weights: A, B^T and bounds of four projections");
    layers_.at(layer).lora = std::move(weights);
  }

  // One decode-only step: logits (float32) of `logits_rows` among the B one-token rows.
  // `lora_rows`, `lora_ends`: the rows that carry an adapter, sorted by slot, and each
  // slot's cumulative row count (undefined: none does).
  Tensor forward(Tensor ids, Tensor positions, Tensor slots, Tensor tables, Tensor lens,
                 const std::vector<Tensor>& k_caches, const std::vector<Tensor>& v_caches,
                 Tensor logits_rows, double scale, int64_t block_size, Tensor lora_rows,
                 Tensor lora_ends, Tensor tree) {
    TORCH_CHECK(!k_caches.empty(), "one K and one V cache per layer");
    const auto run = [&]<typename T>() {
      return with_cache_type<T>(k_caches[0].scalar_type(), [&]<typename C>() {
        return step<T, C>(ids, positions, slots, tables, lens, k_caches, v_caches, logits_rows,
                          scale, block_size, lora_rows, lora_ends, tree);
      });
    };
    if (final_norm_.scalar_type() == at::kFloat) return run.template operator()<float>();
    return run.template operator()<BFloat16>();
  }

 private:
  // T: the model's dtype; C: its caches' elements (kv_rows.h).
  template <typename T, typename C>
  Tensor step(Tensor ids, Tensor positions, Tensor slots, Tensor tables, Tensor lens,
              const std::vector<Tensor>& k_caches, const std::vector<Tensor>& v_caches,
              Tensor logits_rows, double scale, int64_t block_size, Tensor lora_rows,
              Tensor lora_ends, Tensor tree) {
    TORCH_CHECK(k_caches.size() == layers_.size() && v_caches.size() == layers_.size(),
                "one K and one V cache per layer");
    const bool lora = lora_rows.defined();
    TORCH_CHECK(!lora || (lora_ends.defined() && !layers_.empty() && !layers_[0].lora.empty()),
                "LoRA rows given to a decoder without LoRA slots");
    const bool embeds = !stage_ || embeds_;
    Tensor received;  // a later pipeline stage's input: the previous stage's states
    if (!embeds) {
      TORCH_CHECK(ids.dim() == 2 && ids.size(1) == final_norm_.size(0) &&
                      ids.scalar_type() == final_norm_.scalar_type(),
                  "a later pipeline stage takes [rows, hidden] states in the model's dtype");
      received = ids.contiguous().clone();  // the residual stream, updated in place
    } else {
      ids = ids.to(at::kLong).contiguous();
    }
    positions = positions.to(at::kLong).contiguous();
    slots = slots.to(at::kLong).contiguous();
    tables = tables.to(at::kLong).contiguous();
    lens = lens.to(at::kLong).contiguous();
    const int64_t rows = ids.size(0), hid = final_norm_.size(0);
    check_tables(tables, lens, rows, k_caches[0].size(0), block_size);
    const int64_t* tree_data = tree_rows(tree, rows);
    TORCH_CHECK(!batch_invariant_ || tree_data == nullptr,
                "batch-invariant attention verifies paths, not trees");
    const Tensor starts = batch_invariant_ ? at::arange(rows + 1, lens.options()) : Tensor();
    check_slots(slots, rows, k_caches[0].size(0) * block_size, 0);
    const int64_t qkv_width = (heads_ + 2 * hkv_) * d_;
    Tensor outside;  // a tensor-parallel rank's: the tokens whose rows others hold
    if (reduce_ && embeds) {
      ids = ids - vocab_start_;
      const int64_t held = embed_.defined() ? embed_.size(0) : embed_gguf_.data.size(0);
      outside = (ids < 0).logical_or(ids >= held);
      ids = ids.masked_fill(outside, 0);
    }
    Tensor h;
    if (!embeds) {
      h = received;
    } else if (embed_.defined()) {
      h = embed_.index_select(0, ids).contiguous();
    } else {
      h = at::empty({rows, hid}, final_norm_.options());
      gguf_get_rows(embed_gguf_, ids, h);
    }
    if (reduce_ && embeds) {
      h.masked_fill_(outside.unsqueeze(1), 0);
      reduce_(h);
    }
    Tensor x = at::empty_like(h);
    Tensor cos = cos_.index_select(0, positions), sin = sin_.index_select(0, positions);
    Tensor attn = at::empty({rows, heads_ * d_}, h.options());
    Tensor act = at::empty({rows, inter_}, h.options());
    Tensor y;  // the last projection's output, added to h by the next norm
    for (size_t l = 0; l < layers_.size(); ++l) {
      const Layer& L = layers_[l];
      check_cache(k_caches[l], h.scalar_type(), d_);
      check_cache(v_caches[l], h.scalar_type(), d_);
      TORCH_CHECK(k_caches[l].scalar_type() == k_caches[0].scalar_type() &&
                      v_caches[l].scalar_type() == k_caches[0].scalar_type(),
                  "every layer's caches of one dtype");
      add_rms_norm<T>(h.data_ptr<T>(), y.defined() ? y.data_ptr<T>() : nullptr, h.data_ptr<T>(),
                      L.norm1.data_ptr<T>(), x.data_ptr<T>(), rows, hid, eps_);
      Tensor qkv = L.qkv(x).contiguous();
      if (lora) lora_add(x, qkv, L.lora[0], L.lora[1], lora_rows, lora_ends, L.lora[2]);
      T* qp = qkv.data_ptr<T>();
      if (L.rope)
        rope<T>(qp, qkv_width, cos.data_ptr<float>(), sin.data_ptr<float>(), rows, heads_ + hkv_,
                d_, cos_.size(1));
      write_kv<T, C>(qp, qkv_width, heads_ * d_, slots.data_ptr<int64_t>(), rows, hkv_, d_,
                     k_caches[l].data_ptr<C>());
      write_kv<T, C>(qp, qkv_width, (heads_ + hkv_) * d_, slots.data_ptr<int64_t>(), rows, hkv_,
                     d_, v_caches[l].data_ptr<C>());
      if (batch_invariant_)
        attn.copy_(paged_prefill_attention(
                       qkv.narrow(1, 0, heads_ * d_).view({rows, heads_, d_}), k_caches[l],
                       v_caches[l], tables, starts, lens, scale, 1, L.window)
                       .view({rows, heads_ * d_}));
      else
        paged_attention<T, C>(qp, qkv_width, k_caches[l].data_ptr<C>(),
                              v_caches[l].data_ptr<C>(), tables.data_ptr<int64_t>(),
                              tables.size(1), lens.data_ptr<int64_t>(), tree_data, rows, heads_,
                              hkv_, d_, block_size, static_cast<float>(scale), L.window,
                              attn.data_ptr<T>());
      y = L.o(attn).contiguous();
      if (lora) lora_add(attn, y, L.lora[3], L.lora[4], lora_rows, lora_ends, L.lora[5]);
      if (reduce_) reduce_(y);
      add_rms_norm<T>(h.data_ptr<T>(), y.data_ptr<T>(), h.data_ptr<T>(), L.norm2.data_ptr<T>(),
                      x.data_ptr<T>(), rows, hid, eps_);
      Tensor gate_up = L.gate_up(x).contiguous();
      if (lora) lora_add(x, gate_up, L.lora[6], L.lora[7], lora_rows, lora_ends, L.lora[8]);
      // ATen's vectorised SiLU: its exp rounds as the PyTorch path's does.
      at::mul_out(act, at::silu(gate_up.narrow(1, 0, inter_)),
                  gate_up.narrow(1, inter_, inter_));
      y = L.down(act).contiguous();
      if (lora) lora_add(act, y, L.lora[9], L.lora[10], lora_rows, lora_ends, L.lora[11]);
      if (reduce_) reduce_(y);
    }
    if (stage_ && !ends_) {  // a pipeline stage before the last: the residual stream
      add_into<T>(h.data_ptr<T>(), y.data_ptr<T>(), rows * hid);
      return h;
    }
    // The final norm of h + the last MLP output; the LM head only for the rows that sample.
    add_rms_norm<T>(h.data_ptr<T>(), y.data_ptr<T>(), h.data_ptr<T>(), final_norm_.data_ptr<T>(),
                    x.data_ptr<T>(), rows, hid, eps_);
    if (logits_rows.size(0) != rows) x = x.index_select(0, logits_rows.to(at::kLong));
    if (stage_) return x;  // the last stage's final states
    return lm_head_(x).to(at::kFloat);
  }

  Tensor embed_;
  GGUFPart embed_gguf_;
  Tensor final_norm_;
  Linear lm_head_;
  Tensor cos_, sin_;
  int64_t heads_, hkv_, d_, inter_;
  float eps_;
  std::vector<Layer> layers_;
  bool batch_invariant_ = false;
  std::function<void(Tensor&)> reduce_;  // set: a tensor-parallel rank's
  int64_t vocab_start_ = 0;
  bool stage_ = false, embeds_ = true, ends_ = true;  // a pipeline stage's (set_stage)
};

}  // namespace tidal_cpu

// Types local to the module: builds for other instruction sets load beside it (tests).
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using namespace tidal_cpu;
  py::class_<Linear>(m, "Linear", py::module_local())
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
      .def_static("from_gguf", [](std::shared_ptr<GGUFProjection> g) {
             Linear l;
             l.kind = 3;
             l.gguf = std::move(g);
             return l;
           })
      .def_readwrite("fixed_rows", &Linear::fixed_rows)
      .def("__call__", &Linear::operator());
  py::class_<GGUFPart>(m, "GGUFPart", py::module_local())
      .def(py::init([](Tensor data, int64_t type, bool planar, bool rounds) {
             return GGUFPart{data, type, planar, rounds};
           }), py::arg("data"), py::arg("type"), py::arg("planar"), py::arg("rounds") = false);
  py::class_<GGUFProjection, std::shared_ptr<GGUFProjection>>(m, "GGUFProjection",
                                                          py::module_local())
      .def(py::init([](std::vector<GGUFPart> parts, c10::optional<Tensor> bias, int64_t max_rows,
                       int64_t twice_max_rows, int64_t tile_rows, bool tile_bf16,
                       int64_t panel_rows, bool bf16_panels, bool amx,
                       c10::optional<Tensor> in_perm) {
             return std::make_shared<GGUFProjection>(std::move(parts), bias.value_or(Tensor()),
                                                     max_rows, twice_max_rows, tile_rows,
                                                     tile_bf16, panel_rows, bf16_panels, amx,
                                                     in_perm.value_or(Tensor()));
           }), py::arg("parts"), py::arg("bias"), py::arg("max_rows"),
           py::arg("twice_max_rows"), py::arg("tile_rows"), py::arg("tile_bf16") = false,
           py::arg("panel_rows") = 0, py::arg("bf16_panels") = false, py::arg("amx") = false,
           py::arg("in_perm") = py::none())
      .def_readonly("bf16_panels", &GGUFProjection::bf16_panels)
      .def("__call__", [](const GGUFProjection& g, const Tensor& x, c10::optional<Tensor> twice,
                          bool bf16_out) {
             return g(x, twice.value_or(Tensor()), bf16_out);
           }, py::arg("x"), py::arg("twice") = py::none(), py::arg("bf16_out") = false,
           py::call_guard<py::gil_scoped_release>());
  py::class_<Decoder>(m, "Decoder", py::module_local())
      .def(py::init([](c10::optional<Tensor> embed, c10::optional<GGUFPart> embed_gguf,
                       Tensor final_norm, Linear lm_head, Tensor cos, Tensor sin, int64_t heads,
                       int64_t kv_heads, int64_t head_dim, int64_t intermediate, double eps) {
             return Decoder(embed.value_or(Tensor()), embed_gguf.value_or(GGUFPart{}), final_norm,
                            lm_head, cos, sin, heads, kv_heads, head_dim, intermediate, eps);
           }))
      .def("add_layer", &Decoder::add_layer, py::arg("norm1"), py::arg("norm2"), py::arg("qkv"),
           py::arg("o"), py::arg("gate_up"), py::arg("down"), py::arg("window"),
           py::arg("rope") = true)
      .def("set_lora", &Decoder::set_lora)
      .def("set_batch_invariant", &Decoder::set_batch_invariant)
      .def("set_all_reduce", [](Decoder& d, ShmReduce reduce, int64_t vocab_start) {
             d.set_all_reduce([reduce](Tensor& y) { reduce(y); }, vocab_start);
           })
      .def("set_all_reduce", [](Decoder& d, py::function reduce, int64_t vocab_start) {
             // called from a step that released the GIL; the callable lives as long as the
             // decoder, dropped with the GIL held (its deleter takes it)
             auto held = std::shared_ptr<py::function>(
                 new py::function(std::move(reduce)), [](py::function* f) {
                   py::gil_scoped_acquire gil;
                   delete f;
                 });
             d.set_all_reduce([held](Tensor& y) {
               py::gil_scoped_acquire gil;
               (*held)(y);
             }, vocab_start);
           })
      .def("set_stage", &Decoder::set_stage)
      .def("forward", [](Decoder& d, Tensor ids, Tensor positions, Tensor slots, Tensor tables,
                         Tensor lens, const std::vector<Tensor>& k_caches,
                         const std::vector<Tensor>& v_caches, Tensor logits_rows, double scale,
                         int64_t block_size, c10::optional<Tensor> lora_rows,
                         c10::optional<Tensor> lora_ends, c10::optional<Tensor> tree) {
             return d.forward(ids, positions, slots, tables, lens, k_caches, v_caches,
                              logits_rows, scale, block_size, lora_rows.value_or(Tensor()),
                              lora_ends.value_or(Tensor()), tree.value_or(Tensor()));
           }, py::arg("ids"), py::arg("positions"), py::arg("slots"), py::arg("tables"),
           py::arg("lens"), py::arg("k_caches"), py::arg("v_caches"), py::arg("logits_rows"),
           py::arg("scale"), py::arg("block_size"), py::arg("lora_rows") = py::none(),
           py::arg("lora_ends") = py::none(), py::arg("tree") = py::none(),
           py::call_guard<py::gil_scoped_release>());
  py::class_<ShmReduce>(m, "ShmReduce", py::module_local())
      .def(py::init([](int64_t address, int64_t rank, int64_t size, int64_t slot_floats,
                       double timeout_s) {
             return ShmReduce{reinterpret_cast<uint8_t*>(address), rank, size, slot_floats,
                              timeout_s};
           }), py::arg("address"), py::arg("rank"), py::arg("size"), py::arg("slot_floats"),
           py::arg("timeout_s"))
      .def("__call__", [](const ShmReduce& r, Tensor y) { r(y); },
           py::call_guard<py::gil_scoped_release>());
  m.def("paged_decode_attention", [](Tensor q, Tensor k_cache, Tensor v_cache, Tensor tables,
                                     Tensor lens, double scale, int64_t window,
                                     c10::optional<Tensor> tree) {
    return paged_decode_attention(q, k_cache, v_cache, tables, lens, scale, window,
                                  tree.value_or(Tensor()));
  }, py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("tables"), py::arg("lens"),
        py::arg("scale"), py::arg("window") = 0, py::arg("tree") = py::none(),
        py::call_guard<py::gil_scoped_release>());
  m.def("paged_prefill_attention", &paged_prefill_attention, py::arg("q"), py::arg("k_cache"),
        py::arg("v_cache"), py::arg("tables"), py::arg("starts"), py::arg("lens"),
        py::arg("scale"), py::arg("max_query_len"), py::arg("window") = 0,
        py::call_guard<py::gil_scoped_release>());
  m.def("lora_add", &lora_add, py::arg("x"), py::arg("y"), py::arg("a"), py::arg("b"),
        py::arg("rows"), py::arg("ends"), py::arg("bounds"),
        py::call_guard<py::gil_scoped_release>());
  m.def("grouped_linear", &grouped_linear, py::arg("xs"), py::arg("ends"), py::arg("w"),
        py::call_guard<py::gil_scoped_release>());
  m.def("int4_linear", [](Tensor x, Tensor q4, Tensor scale_min, c10::optional<Tensor> bias) {
    return int4_linear(x, q4, scale_min, bias.value_or(Tensor()));
  }, py::arg("x"), py::arg("q4"), py::arg("scale_min"), py::arg("bias") = py::none(),
        py::call_guard<py::gil_scoped_release>());
  m.def("gguf_linear", [](Tensor x, Tensor w, int64_t type, bool planar,
                          c10::optional<Tensor> bias, bool rounds) {
    return gguf_linear(x, GGUFPart{w, type, planar, rounds}, bias.value_or(Tensor()));
  }, py::arg("x"), py::arg("w"), py::arg("type"), py::arg("planar"),
        py::arg("bias") = py::none(), py::arg("rounds") = false,
        py::call_guard<py::gil_scoped_release>());
  m.def("gguf_get_rows", [](Tensor w, int64_t type, bool planar, Tensor ids, Tensor out,
                            bool rounds) {
    gguf_get_rows(GGUFPart{w, type, planar, rounds}, ids, out);
  }, py::arg("w"), py::arg("type"), py::arg("planar"), py::arg("ids"), py::arg("out"),
        py::arg("rounds") = false, py::call_guard<py::gil_scoped_release>());
  m.def("rms_norm", &rms_norm, py::arg("x"), py::arg("weight"), py::arg("eps"),
        py::call_guard<py::gil_scoped_release>());
  m.def("fused_add_rms_norm", &fused_add_rms_norm, py::arg("x"), py::arg("residual"),
        py::arg("weight"), py::arg("eps"), py::call_guard<py::gil_scoped_release>());
  m.def("rope_and_cache", &rope_and_cache, py::arg("qk"), py::arg("v"), py::arg("cos"),
        py::arg("sin"), py::arg("k_cache"), py::arg("v_cache"), py::arg("slot_mapping"),
        py::arg("num_q_heads"), py::call_guard<py::gil_scoped_release>());
  m.def("silu_mul", &silu_mul, py::arg("gate_up"), py::arg("dtype"),
        py::call_guard<py::gil_scoped_release>());
  m.def("apply_token_bitmask", &apply_token_bitmask, py::arg("logits"), py::arg("words"),
        py::call_guard<py::gil_scoped_release>());
  m.attr("gguf_nibble_rounds") = gguf_nibble_rounds();
  m.attr("gguf_amx") = gguf_amx();
  m.attr("gguf_int8_panels") = gguf_int8_panels();
  m.attr("gguf_amx_bf16") = gguf_amx_bf16();
  m.attr("gguf_bf16_panels") = gguf_bf16_panels();
  m.attr("prefill_bf16_dots") = prefill_bf16_dots();
}
