"""tidal's C++ CPU decode path (`csrc/`: the decoder, paged attention, projections, routed
experts and GGUF block formats at decode sizes), built once on first use (`extension`).

A decode step of a small model on CPU is bound by per-op dispatch (~60 eager ops a layer),
so `Decoder` runs a whole decode-only step in one call: the projections stay ATen kernels,
everything between them is fused loops, and attention reads the paged cache in place.
`paged_decode_attention` is that attention on its own, for the PyTorch path's decodes
on CPU, and `paged_prefill_attention` its counterpart for prompt runs (`prefill_kernel`
says where it runs). All are optional: without a C++ compiler tidal runs the PyTorch ops.
"""

from __future__ import annotations

from types import ModuleType

import torch
from torch import nn

from tidal.model.attention import BF16_ATTENTION_SCORES, BF16_OVER_CODES
from tidal.model.batch_invariant import FixedRows
from tidal.model.cpu_extension import extension
from tidal.model.gguf_quants import GGUFEmbedding, GGUFLinear
from tidal.model.linear import Int4Linear, PackedLinear
from tidal.model.tensor_parallel import RowParallel, VocabParallelHead

__all__ = ["build_decoder", "extension", "prefill_kernel", "supports"]


def _linear(ext: ModuleType, module: nn.Module):
    """The C++ view of one projection, or None for a kind it does not run."""
    if isinstance(module, FixedRows):  # batch-invariant: in the same calls of fixed rows
        inner = _linear(ext, module.inner)
        if inner is not None:
            inner.fixed_rows = module.rows
        return inner
    if isinstance(module, GGUFLinear):
        return None if module.projection is None else ext.Linear.from_gguf(module.projection)
    if isinstance(module, Int4Linear):
        d = module.dense
        return ext.Linear(2, d.weight, module.bias, module.packed, module.scales_zeros,
                          module.max_rows, d.weight32, d.bias32, d.fp32_rows,
                          q4=module.ext is not None)
    if isinstance(module, PackedLinear):
        return ext.Linear(1, module.weight, module.bias, w32=module.weight32,
                          bias32=module.bias32, fp32_rows=module.fp32_rows)
    if type(module) is nn.Linear:
        return ext.Linear(0, module.weight, module.bias)
    return None


def prefill_kernel(ext: ModuleType | None, cache: torch.dtype, dtype: torch.dtype):
    """(kernel, fresh_kernel_scores) for a model computing in `dtype` over a cache of element
    dtype `cache`: the C++ paged prefill attention, or None where PyTorch's path (gathered
    context, SDPA) is as fast. Over quantized rows it reads the codes in place (1.1-1.3x on a
    2-core Zen 4 in float32 products, about 2x with AVX512-BF16 products), over bf16 rows only
    with bf16 products (1.7-2.8x; float32 ones tie SDPA), over float32 rows never (it ties
    SDPA), and never on CPUs with AMX, whose bf16 SDPA runs on AMX tiles (BF16_OVER_CODES).
    Fresh prompts take it where its products are bf16 (TorchAttention.fresh_kernel_scores):
    over bf16 rows a bf16 model's at any size (a prefix hit then computes as the fresh prompt
    did), a float32 model's, and any model's over quantized rows, from the scores at which
    PyTorch's path attends in bf16 too (AMX CPUs' over decoded codes alike); below that a
    fresh prompt attends over its own K/V before they are rounded (kv-quantization.md).
    docs/design/cpu-runner.md has the figures."""
    if ext is None or BF16_OVER_CODES:
        return None, None
    if cache in (torch.int8, torch.float8_e4m3fn):
        return ext.paged_prefill_attention, (BF16_ATTENTION_SCORES if ext.prefill_bf16_dots
                                             else None)
    if cache == torch.bfloat16 and ext.prefill_bf16_dots:
        return ext.paged_prefill_attention, (0 if dtype == torch.bfloat16
                                             else BF16_ATTENTION_SCORES)
    return None, None


def supports(arch) -> bool:
    """Whether the C++ decoder runs this architecture: Llama's layers (biases, windows,
    partial rotary and layers without RoPE included), no q/k norms, experts or Gemma's
    norms and soft-caps."""
    return not (arch.qk_norm or arch.moe or arch.gemma or arch.hidden_act != "silu")


class RankDecoder:
    """A tensor-parallel rank's C++ decoder: its step returns the logits of the rank's
    vocabulary rows, which `head` gathers into the whole vocabulary's."""

    def __init__(self, decoder, head: VocabParallelHead) -> None:
        self.decoder, self.head = decoder, head

    def forward(self, *args) -> torch.Tensor:
        return self.head.gather(self.decoder.forward(*args))

    def __getattr__(self, name: str):  # set_lora and the rest: the decoder's own
        return getattr(self.decoder, name)


class StageDecoder:
    """A pipeline stage's C++ decoder over its layers: the previous stage's states in (or
    the ids, on the first), the states on to the next, and the logits of the last stage's
    final states (tidal.model.pipeline_parallel), through the model's head."""

    def __init__(self, decoder, model: nn.Module) -> None:
        self.decoder, self.model = decoder, model

    def forward(self, ids: torch.Tensor, positions, slots, tables, lens, k_caches, v_caches,
                logits_rows: torch.Tensor, *args, **kwargs):
        model, stage = self.model, self.model.stage
        states = stage.start(ids, model.arch.hidden_size, model.norm.weight.dtype)
        out = self.decoder.forward(ids if states is None else states, positions, slots, tables,
                                   lens, k_caches, v_caches, logits_rows, *args, **kwargs)
        final = out if stage.last else out[logits_rows.long()]  # its shape, before the last's
        return stage.finish(out, final, lambda f, _: model.logits(f))

    def __getattr__(self, name: str):  # set_lora and the rest: the decoder's own
        return getattr(self.decoder, name)


def build_decoder(model: nn.Module, all_reduce=None):
    """A C++ `Decoder` sharing `model`'s weights, or None when this model or build cannot
    use one (an architecture it does not run, not bf16 or float32, int8 projections, or no
    compiler). A tensor-parallel rank's model (tidal.model.tensor_parallel.split_model)
    needs `all_reduce`, the extension's ShmReduce of its group (on one machine) or a
    callable summing a tensor over the ranks in place, and gets a RankDecoder; a
    pipeline stage's, a StageDecoder."""
    arch = model.arch
    split = isinstance(model.layers[0].self_attn.o_proj, RowParallel)
    if split and all_reduce is None:
        return None
    if model.norm.weight.dtype not in (torch.bfloat16, torch.float32):
        return None
    if not supports(arch):
        return None
    if model.norm.weight.device.type != "cpu":
        return None
    ext = extension()
    if ext is None:
        return None
    head, embed = model.lm_head, model.embed_tokens
    if split:  # this rank's rows of the vocabulary
        head, embed = head.head, embed.inner
    # A tied head the runner did not convert is the embedding, as a plain linear.
    projections = [_linear(ext, head) if head is not None
                   else ext.Linear(0, embed.weight, None)]
    for layer in model.layers:
        a, m = layer.self_attn, layer.mlp
        o, down = (a.o_proj.linear, m.down_proj.linear) if split else (a.o_proj, m.down_proj)
        projections += [_linear(ext, p) for p in (a.qkv_proj, o, m.gate_up_proj, down)]
    if any(p is None for p in projections):
        return None
    if isinstance(embed, GGUFEmbedding) and embed.quantized is not None:
        q = embed.quantized
        embed_args = (None, ext.GGUFPart(q.data, int(q.qtype), q.planar, q.rounds))
    else:
        embed_args = (embed.table if isinstance(embed, GGUFEmbedding) else embed.weight, None)
    decoder = ext.Decoder(*embed_args, model.norm.weight, projections[0],
                          model.rotary.cos, model.rotary.sin, arch.num_heads,
                          arch.num_kv_heads, arch.head_dim, arch.intermediate_size,
                          arch.rms_norm_eps)
    for i, layer in enumerate(model.layers):
        decoder.add_layer(layer.input_layernorm.weight, layer.post_attention_layernorm.weight,
                          *projections[1 + 4 * i:5 + 4 * i], layer.self_attn.window,
                          layer.rotates)
    if model.backend.batch_invariant:  # attention as the PyTorch path's (batch_invariant.py)
        decoder.set_batch_invariant(True)
    if split:
        decoder.set_all_reduce(all_reduce, model.embed_tokens.start)
    stage = getattr(model, "stage", None)
    if stage is not None:  # its layers, between the others'; the head is the model's
        decoder.set_stage(stage.first, stage.last)
        return StageDecoder(decoder, model)
    return RankDecoder(decoder, model.lm_head) if split else decoder
