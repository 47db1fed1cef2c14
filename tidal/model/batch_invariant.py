"""Batch-invariant inference (`--deterministic`): a request's tokens and logprobs do not
depend on what else its steps hold, on prefix-cache hits, on how its prompt is chunked, on a
preemption's recompute or on speculation.

What makes a row's numbers depend on its step is a kernel chosen, or a reduction ordered,
by the step's row count: oneDNN and MKL pick their blocking by the rows of a GEMM (a
float32 row computed alone differs from the same row among 16 others), the GGUF kernels
cross over to panels and tiles, bf16 and float32 weights trade places, SDPA and the C++
attention kernels sum in their own orders. So every projection runs in calls of exactly
`ROWS` rows (`FixedRows`; a GEMM of one shape computes each row alike wherever it sits),
and every query row, a decode's too, attends through the C++ paged prefill kernel
(TorchAttention.batch_invariant), whose row sums the same keys in the same steps in any
call. The rest (norms, RoPE, activations, sampling) is row by row already. Costs and what
it covers: docs/deterministic.md.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tidal.model.gguf_quants import GGUFLinear
from tidal.model.linear import Int4Linear, Int8Linear, PackedLinear

__all__ = ["ROWS", "FixedRows", "check_supported", "fix_rows"]

# Rows of every projection call: 8 rows and their residuals (a prompt row rounded twice
# brings one) stay on the GGUF VNNI kernels, which run up to 16 rows; 16 rows cost 1.2-1.5x
# a whole 512-row float32 prefill GEMM on a 2-core Zen 4, 8 rows 1.3-1.8x.
ROWS = 8

LEAVES = (nn.Linear, PackedLinear, Int8Linear, Int4Linear, GGUFLinear)


class FixedRows(nn.Module):
    """`inner` (a projection) over x in calls of exactly `rows` rows, the last padded with
    zero rows. A GGUF projection's rows to round twice (PromptRows) are handed to each call
    as that call's own."""

    def __init__(self, inner: nn.Module, rows: int = ROWS) -> None:
        super().__init__()
        self.inner, self.rows = inner, rows
        self.takes_bf16_out = getattr(inner, "takes_bf16_out", False)

    def forward(self, x: torch.Tensor, **kwargs) -> torch.Tensor:
        lead, n = x.shape[:-1], x[..., 0].numel()
        if n == 0:
            return self.inner(x, **kwargs)
        x2 = x.reshape(n, x.shape[-1])
        pad = -n % self.rows
        if pad:
            x2 = F.pad(x2, (0, 0, 0, pad))
        shared = getattr(self.inner, "prompt_rows", None)
        twice = None if shared is None else shared.of(self.inner.is_head, n)
        outs = []
        for start in range(0, n + pad, self.rows):
            if twice is None:
                outs.append(self.inner(x2[start:start + self.rows], **kwargs))
                continue
            own = twice[(twice >= start) & (twice < start + self.rows)] - start
            with shared.only(self.inner.is_head, own, self.rows):
                outs.append(self.inner(x2[start:start + self.rows], **kwargs))
        y = torch.cat(outs)[:n]
        return y.view(*lead, y.shape[-1])

    def extra_repr(self) -> str:
        return f"rows={self.rows}"


def fix_rows(model: nn.Module, rows: int = ROWS) -> nn.Module:
    """Wrap every projection of `model` (inside LoRA, tensor-parallel and other wrappers:
    the weights' own layer) in FixedRows; the model's forward is unchanged."""
    for module in list(model.modules()):
        if isinstance(module, FixedRows):
            continue
        for name, child in list(module.named_children()):
            if isinstance(child, LEAVES):
                setattr(module, name, FixedRows(child, rows))
    embed = getattr(model, "embed_tokens", None)
    if getattr(model, "lm_head", False) is None and isinstance(embed, nn.Embedding):
        tied = nn.Linear(embed.embedding_dim, embed.num_embeddings, bias=False,
                         device="meta")
        tied.weight = embed.weight  # the embedding's own tensor, as the model's head
        model.lm_head = FixedRows(tied, rows)
    return model


def check_supported(arch, device: str, dtype: torch.dtype) -> None:
    """Refuse by name what batch-invariant inference does not cover: a GPU (its kernels are
    not made batch-invariant), float16 (the C++ attention runs bf16 and float32), routed
    experts (grouped GEMMs whose rows per expert change every step)."""
    if device != "cpu":
        raise ValueError(f"--deterministic runs on CPU (--device cpu); this model is on "
                         f"{device}")
    if dtype == torch.float16:
        raise ValueError("--deterministic computes in bfloat16 or float32, not float16")
    if arch.moe:
        raise ValueError("--deterministic does not run routed experts (their grouped "
                         "matmuls take each step's rows per expert)")
