"""A Llama-family decoder over flattened variable-length batches: Llama (2, 3.x), Mistral,
Qwen2/2.5, Qwen3, Phi-3, Gemma 2/3, Granite, SmolLM3, Mixtral and Qwen2/3-MoE differ only in
shapes and flags of `ModelArch` (biases, q/k norms, sliding windows, RoPE schedules, partial
rotary, layers without RoPE, Gemma's norms and soft-capping, routed experts; Granite's
multipliers are folded into its weights at load), so they share these layers.

No padding: a step's tokens from every sequence are one [T] row of ids with their positions.
Q/K/V and gate/up are fused into one matmul each; K/V go to the paged cache through the
attention backend; logits are computed only for the rows that sample.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from tidal.model.attention import AttentionBackend, AttentionMetadata
from tidal.model.config import ModelArch
from tidal.model.linear import products
from tidal.model.mlp import MLP, SparseMoE
from tidal.model.rope import rope_tables


class RMSNorm(nn.Module):
    """Llama's: normalise in float32, scale by w in the model's dtype. `offset` (Gemma):
    scale by (1 + w) in float32, then cast."""

    def __init__(self, dim: int, eps: float, offset: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim) if offset else torch.ones(dim))
        self.eps, self.offset = eps, offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # (F.rms_norm, one op on paper, measured 70 us slower a call in bf16 on CPU.)
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.offset:
            return (x32 * (1.0 + self.weight.float())).to(x.dtype)
        return self.weight * x32.to(x.dtype)


class Rotary(nn.Module):
    """RoPE tables (tidal.model.rope) with the half-split pairing of HF checkpoints:
    x*cos + rotate_half(x)*sin, where rotate_half(x) = roll(x, R/2) with the first half's
    sine negated (one table lookup a step), on the first R = rotary_dim dims of a head."""

    def __init__(self, arch: ModelArch) -> None:
        super().__init__()
        # On the CPU even in a meta-device build: meta ops import torch._dynamo, hence triton.
        with torch.device("cpu"):
            cos, sin = rope_tables(arch.rope, arch.context_length)
            self.register_buffer("cos", cos, persistent=False)
            self.register_buffer("sin", sin, persistent=False)
            self.local = arch.local_rope is not None  # sliding layers' own tables (Gemma 3)
            if self.local:
                cos, sin = rope_tables(arch.local_rope, arch.context_length)
                self.register_buffer("local_cos", cos, persistent=False)
                self.register_buffer("local_sin", sin, persistent=False)
        self.nope = not all(arch.rope_layers)  # some layers rotate nothing (SmolLM3)

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> list:
        """Each schedule's cos and signed sin of each token, [T, 1, R], shared by the
        step's layers: [global], [global, local], and last the identity (cos 1, sin 0)
        where some layers rotate nothing."""
        pairs = [(self.cos, self.sin)] + ([(self.local_cos, self.local_sin)] if self.local
                                          else [])
        out = [(cos[positions].unsqueeze(1).to(dtype), sin[positions].unsqueeze(1).to(dtype))
               for cos, sin in pairs]
        if self.nope:
            out.append((torch.ones_like(out[0][0]), torch.zeros_like(out[0][1])))
        return out


def apply_rope(x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    cos, sin = rope
    r = cos.shape[-1]
    if r == x.shape[-1]:
        return x * cos + x.roll(r // 2, dims=-1) * sin
    # Partial rotary: the first r dims rotate among themselves, the rest pass unchanged.
    rot = x[..., :r]
    return torch.cat([rot * cos + rot.roll(r // 2, dims=-1) * sin, x[..., r:]], dim=-1)


class Attention(nn.Module):
    def __init__(self, arch: ModelArch, backend: AttentionBackend, window: int = 0) -> None:
        super().__init__()
        self.h, self.hkv, self.d = arch.num_heads, arch.num_kv_heads, arch.head_dim
        self.qkv_proj = nn.Linear(arch.hidden_size, (self.h + 2 * self.hkv) * self.d,
                                  bias=arch.qkv_bias)
        self.o_proj = nn.Linear(self.h * self.d, arch.hidden_size, bias=arch.o_bias)
        self.window = window  # sliding window: attend to the last `window` positions
        if arch.qk_norm:
            self.q_norm = RMSNorm(self.d, arch.rms_norm_eps, arch.gemma)
            self.k_norm = RMSNorm(self.d, arch.rms_norm_eps, arch.gemma)
        self.qk_norm = arch.qk_norm
        self.backend = backend

    def forward(self, x, rope, k_cache, v_cache, meta: AttentionMetadata, rope_and_cache=None):
        """`rope_and_cache` (a fused kernel, tidal.model.kernels): rotates q and k and writes
        k and v to the cache in one launch, so the backend only attends; the fused norm after
        it then reads o_proj's products as they leave it (linear.products)."""
        t, h = x.shape[0], self.h
        qkv = self.qkv_proj(x).view(t, h + 2 * self.hkv, self.d)
        qk, v = qkv[:, :h + self.hkv], qkv[:, h + self.hkv:]
        if self.qk_norm:
            qk = torch.cat([self.q_norm(qk[:, :h]), self.k_norm(qk[:, h:])], dim=1)
        if rope_and_cache is not None:
            q, k = rope_and_cache(qk, v, *rope, k_cache, v_cache, meta.slot_mapping, h)
            o = self.backend.forward(q, k, v, k_cache, v_cache, meta, self.window, written=True)
            return products(self.o_proj, o.view(t, h * self.d))
        qk = apply_rope(qk, rope)  # q and k heads in one go
        o = self.backend.forward(qk[:, :h], qk[:, h:], v, k_cache, v_cache, meta, self.window)
        return self.o_proj(o.view(t, h * self.d))


class DecoderLayer(nn.Module):
    """Pre-norm attention and feed-forward blocks with residuals; Gemma also normalises
    each block's output (post_attention_layernorm, post_feedforward_layernorm)."""

    def __init__(self, arch: ModelArch, backend: AttentionBackend, index: int) -> None:
        super().__init__()
        window = arch.windows[index]
        self.rotates = not arch.rope_layers or arch.rope_layers[index]
        # its tables in Rotary.tables' list: the last is the identity
        self.rope_index = int(arch.local_rope is not None and window > 0) if self.rotates else -1
        norm = lambda: RMSNorm(arch.hidden_size, arch.rms_norm_eps, arch.gemma)  # noqa: E731
        self.input_layernorm = norm()
        self.self_attn = Attention(arch, backend, window)
        self.post_attention_layernorm = norm()
        self.sandwich = arch.gemma
        if self.sandwich:
            self.pre_feedforward_layernorm = norm()
            self.post_feedforward_layernorm = norm()
        self.mlp = (SparseMoE(arch) if arch.moe and arch.moe.layers[index]
                    else MLP(arch.hidden_size, arch.intermediate_size, arch.hidden_act,
                             arch.mlp_bias))

    def forward(self, h, ropes, k_cache, v_cache, meta):
        a = self.self_attn(self.input_layernorm(h), ropes[self.rope_index], k_cache, v_cache,
                           meta)
        if not self.sandwich:
            h = h + a
            return h + self.mlp(self.post_attention_layernorm(h))
        h = h + self.post_attention_layernorm(a)
        return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))

    def fused_forward(self, h, residual, ropes, k_cache, v_cache, meta, kernels):
        """The same layer with fused kernels (not Gemma's): returns (MLP output, residual
        stream) and leaves the add to the next layer's norm, which fuses it."""
        norm, post = self.input_layernorm, self.post_attention_layernorm
        if residual is None:
            x, residual = kernels.rms_norm(h, norm.weight, norm.eps), h
        else:
            x, residual = kernels.add_rms_norm(h, residual, norm.weight, norm.eps)
        a = self.self_attn(x, ropes[self.rope_index], k_cache, v_cache, meta,
                           kernels.rope_and_cache)
        x, residual = kernels.add_rms_norm(a, residual, post.weight, post.eps)
        mlp = self.mlp
        if kernels.silu_mul is not None and getattr(mlp, "silu", False):
            return mlp.fused(x, kernels.silu_mul), residual
        return mlp(x), residual


class StepCut(Exception):
    """A forward pass stopped between layers at its `between_layers` hook's word."""


class LlamaModel(nn.Module):
    """Embeddings, decoder layers, final norm and the LM head (tied or not)."""

    def __init__(self, arch: ModelArch, backend: AttentionBackend) -> None:
        super().__init__()
        self.arch = arch
        self.backend = backend
        # Uninitialised (the loader fills it): normal_ on meta would import torch._dynamo, triton.
        self.embed_tokens = nn.Embedding.from_pretrained(
            torch.empty(arch.vocab_size, arch.hidden_size), freeze=False)
        self.layers = nn.ModuleList(DecoderLayer(arch, backend, i)
                                    for i in range(arch.num_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, arch.gemma)
        self.lm_head = (None if arch.tie_word_embeddings
                        else nn.Linear(arch.hidden_size, arch.vocab_size, bias=False))
        self.rotary = Rotary(arch)
        self.kernels = None  # FusedKernels (Triton or C++): norms, adds, RoPE, cache writes
        self.stage = None  # a pipeline stage's StageLinks (tidal.model.pipeline_parallel)
        self.prompt_rows = None  # GGUF layers' PromptRows (tidal.model.gguf_quants), if any
        # asked before each layer: True stops the forward pass with StepCut (a step its
        # runner may cut short, tidal/core/step_cut.py)
        self.between_layers: Callable[[], bool] | None = None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata,
                logits_indices: torch.Tensor, hidden_indices: torch.Tensor | None = None,
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Logits (float32) of the rows in `logits_indices`. With `hidden_indices`, also the
        final (normed) hidden states of those rows, as (logits, hidden): the caller runs them
        through `logits()` in slices, so a long prompt never holds all its logits at once.
        A pipeline stage that defers its end returns them as a `Pending`."""
        stage = self.stage
        h = None if stage is None else stage.start(input_ids, self.arch.hidden_size,
                                                   self.norm.weight.dtype)
        if h is None:
            h = self.embed_tokens(input_ids)
            if self.arch.gemma:  # Gemma scales its embeddings by sqrt(hidden), in their dtype
                h = h * torch.tensor(self.arch.hidden_size ** 0.5, dtype=h.dtype)
        ropes = self.rotary.tables(positions, h.dtype)
        between, final = self.between_layers, None
        if self.kernels is None:
            for layer, (k_cache, v_cache) in zip(self.layers, kv_caches):
                if between is not None and between():
                    raise StepCut
                h = layer(h, ropes, k_cache, v_cache, meta)
        else:
            residual = None
            for layer, (k_cache, v_cache) in zip(self.layers, kv_caches):
                if between is not None and between():
                    raise StepCut
                h, residual = layer.fused_forward(h, residual, ropes, k_cache, v_cache, meta,
                                                  self.kernels)
            if self.backend.batch_invariant:  # the final norm fused, as the C++ decoder's
                final = self.kernels.add_rms_norm(h[logits_indices], residual[logits_indices],
                                                  self.norm.weight, self.norm.eps)[0]
            h = h + residual
        if final is None:
            final = self.norm(h[logits_indices])
        hidden = None if hidden_indices is None else self.norm(h[hidden_indices])
        if hidden is not None and self.arch.head_fold != 1.0:  # the states before the fold
            hidden = hidden / self.arch.head_fold
        if stage is None:
            return self._head(final, hidden)
        return stage.finish(h, final, self._head, hidden)

    def _head(self, final: torch.Tensor, hidden: torch.Tensor | None):
        """forward's result from the final states: logits, or (logits, hidden)."""
        logits = self.logits(final)
        return logits if hidden is None else (logits, hidden)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """The LM head (and final soft cap) over normed hidden states, in float32."""
        head = self.lm_head  # a module of its own once the runner converts a tied embedding
        logits = (head(h) if head is not None else F.linear(h, self.embed_tokens.weight)).float()
        cap = self.arch.final_softcap
        return torch.tanh(logits / cap) * cap if cap else logits
