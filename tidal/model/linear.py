"""Faster linear layers for CPU decoding, where reading the weights bounds a step.

`PackedLinear` keeps a bf16 weight in oneDNN's blocked layout (what torch.compile's freezing
does), which reads memory about twice as fast as `F.linear` at small batch and gives the same
numbers. `Int8Linear` is weight-only int8 (half the bytes again), per-channel absmax.
"""

from __future__ import annotations

import torch
from torch import nn


class PackedLinear(nn.Module):
    """y = x @ W^T (+ bias) with W pre-packed for oneDNN; bf16 on CPU."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.out_features = weight.shape[0]
        self.register_buffer("weight", torch.ops.mkldnn._reorder_linear_weight(
            weight.detach().contiguous(), 1))
        self.bias = None if bias is None else bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")


class Int8Linear(nn.Module):
    """y = x @ (int8 weight * per-output-channel scale)^T (+ bias); symmetric, absmax."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        w = weight.detach().float()
        scale = w.abs().amax(dim=1).clamp(min=1e-8) / 127.0
        self.register_buffer("weight", torch.round(w / scale[:, None]).clamp(-127, 127)
                             .to(torch.int8).contiguous())
        self.register_buffer("scale", scale.to(weight.dtype))
        self.bias = None if bias is None else bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        y = torch._weight_int8pack_mm(x.reshape(-1, shape[-1]), self.weight, self.scale)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*shape[:-1], -1)


def can_pack(dtype: torch.dtype, device: str) -> bool:
    """oneDNN packing pays (and keeps results bit-identical) for bf16 on CPU."""
    return (device == "cpu" and dtype == torch.bfloat16 and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


def replace_linears(model: nn.Module, kind: type[PackedLinear] | type[Int8Linear]) -> nn.Module:
    """Swap every projection for `kind`; a tied LM head gets its own converted copy of the
    embedding (the embedding itself stays a lookup table)."""
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                setattr(module, name, kind(child.weight, child.bias))
    if getattr(model, "lm_head", False) is None and hasattr(model, "embed_tokens"):
        model.lm_head = kind(model.embed_tokens.weight)
    return model
