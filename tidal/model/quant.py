"""Weight-only int8 linear layers for CPU decoding, where reading weights bounds a step:
int8 halves the bytes of bf16 and torch has a fused int8-weight matmul for CPU."""

from __future__ import annotations

import torch
from torch import nn


class Int8Linear(nn.Module):
    """y = x @ (int8 weight * per-output-channel scale)^T (+ bias); symmetric, absmax."""

    def __init__(self, linear: nn.Linear | torch.Tensor) -> None:
        super().__init__()
        weight = linear.weight if isinstance(linear, nn.Linear) else linear
        w = weight.detach().float()
        scale = w.abs().amax(dim=1).clamp(min=1e-8) / 127.0
        self.register_buffer("weight", torch.round(w / scale[:, None]).clamp(-127, 127)
                             .to(torch.int8).contiguous())
        self.register_buffer("scale", scale.to(weight.dtype))
        bias = getattr(linear, "bias", None)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        y = torch._weight_int8pack_mm(x.reshape(-1, shape[-1]), self.weight, self.scale)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*shape[:-1], -1)


def quantize_int8(model: nn.Module) -> nn.Module:
    """Swap every projection (and the LM head) for an Int8Linear; norms and embeddings stay."""
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                setattr(module, child_name, Int8Linear(child))
    if getattr(model, "lm_head", None) is None and hasattr(model, "embed_tokens"):
        model.lm_head_int8 = Int8Linear(model.embed_tokens.weight)  # tied: quantized copy
    return model
