"""Batch-invariant inference (`--deterministic`): a request's tokens and logprobs do not
depend on what else its steps hold, on prefix-cache hits, on how its prompt is chunked, on a
preemption's recompute or on speculation.

What makes a row's numbers depend on its step is a kernel chosen, or a reduction ordered,
by the step's row count: oneDNN and MKL pick their blocking by the rows of a GEMM (a
float32 row computed alone differs from the same row among 16 others), the GGUF kernels
cross over to panels and tiles, SDPA and the C++ attention kernels sum in their own orders.
So a dense projection runs in calls of exactly `ROWS` rows (`FixedRows`: a GEMM of one
shape computes each row alike wherever it sits), a GGUF one on its integer kernels at any
row count (their sums are each row's own: GGUFLinear.one_kernel), and every query row, a
decode's too, attends through the C++ paged prefill kernel (TorchAttention.batch_invariant),
whose row sums the same keys in the same steps in any call. The rest (norms, RoPE,
activations, sampling) is row by row already. Costs and coverage: docs/design/deterministic.md.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tidal.model.gguf_quants import GGUFLinear
from tidal.model.linear import Int4Linear, Int8Linear, PackedLinear

__all__ = ["ROWS", "FixedRows", "check_supported", "make_batch_invariant"]

# Rows of every dense projection call: a 512-row float32 prefill GEMM of SmolLM2's shapes
# took 1.2-1.3x its time in calls of 16 rows, 1.3-1.8x in calls of 8 (2-core Zen 4).
ROWS = 16

DENSE = (nn.Linear, PackedLinear, Int8Linear, Int4Linear)


class FixedRows(nn.Module):
    """`inner` (a dense projection) over x in calls of exactly `rows` rows, the last padded
    with zero rows."""

    def __init__(self, inner: nn.Module, rows: int = ROWS) -> None:
        super().__init__()
        self.inner, self.rows = inner, rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead, n = x.shape[:-1], x[..., 0].numel()
        x2 = x.reshape(n, x.shape[-1])
        total = max(1, -(-n // self.rows)) * self.rows  # an empty x takes one call too
        if total > n:
            x2 = F.pad(x2, (0, 0, 0, total - n))
        parts = [self.inner(part) for part in x2.split(self.rows)]
        y = (parts[0] if len(parts) == 1 else torch.cat(parts))[:n]  # a decode's: one call
        return y.reshape(*lead, y.shape[-1])

    def extra_repr(self) -> str:
        return f"rows={self.rows}"


def make_batch_invariant(model: nn.Module, rows: int = ROWS) -> nn.Module:
    """Every projection of `model` (the weights' own layer, inside any wrapper) made
    batch-invariant: GGUF ones on one kernel, dense ones wrapped in FixedRows; the model's
    forward is unchanged. Before the C++ decoder is built, which takes them as they are."""
    def walk(module: nn.Module) -> None:
        for name, child in module.named_children():
            if isinstance(child, GGUFLinear):
                child.one_kernel()
            elif isinstance(child, DENSE):
                setattr(module, name, FixedRows(child, rows))
            elif not isinstance(child, FixedRows):
                walk(child)

    walk(model)
    embed = getattr(model, "lm_head", False) is None and getattr(model, "embed_tokens", None)
    if isinstance(embed, nn.Embedding):  # a tied head the runner multiplies by F.linear
        tied = nn.Linear(embed.embedding_dim, embed.num_embeddings, bias=False,
                         device="meta")
        tied.weight = embed.weight  # the embedding's own tensor
        model.lm_head = FixedRows(tied, rows)
    return model


def check_supported(arch, device: str, dtype: torch.dtype) -> None:
    """Refuse by name what batch-invariant inference does not cover: a GPU (its kernels are
    not made batch-invariant), float16 (the C++ attention runs bf16 and float32), routed
    experts (grouped GEMMs whose rows per expert change every step), soft-capped attention
    scores (Gemma 2: eager attention, never the C++ kernel)."""
    if device != "cpu":
        raise ValueError(f"--deterministic runs on CPU (--device cpu); this model is on "
                         f"{device}")
    if dtype == torch.float16:
        raise ValueError("--deterministic computes in bfloat16 or float32, not float16")
    if arch.moe:
        raise ValueError("--deterministic does not run routed experts (their grouped "
                         "matmuls take each step's rows per expert)")
    if arch.attn_softcap:
        raise ValueError("--deterministic does not run soft-capped attention scores "
                         "(Gemma 2): they take eager attention, not the C++ kernel")
