"""Faster linear layers for CPU decoding, where reading the weights bounds a step.

`PackedLinear` keeps a bf16 or float32 weight in oneDNN's blocked layout (what torch.compile's
freezing does), which reads memory about twice as fast as `F.linear` at small batch and gives
the same numbers. On CPUs whose bf16 GEMMs are the slower ones (no AMX; Intel's AVX512-BF16)
a bf16 layer can also keep a float32 copy for steps of many rows: there oneDNN's bf16 GEMM
computes at about half its float32 rate, so from ~16 rows
multiplying the bf16 values in float32 is faster although it reads twice the bytes (see
`fp32_rows`). Where oneDNN has no bf16 kernels at all (plain AVX2) the copy serves every step.
Every oneDNN call sees one of a few row counts (`row_bucket`, chunks of `ROW_CHUNK`): oneDNN
and PyTorch cache a primitive per matrix shape, each holding buffers of about rows x outputs
floats, so a server that met every step size from 1 to 16,384 would grow by gigabytes.
`Int8Linear` is weight-only int8, per-channel absmax. `Int4Linear` is weight-only int4 in
groups of 32 with a scale and a zero each: the Q4_1 format of the embedded GGUF, so
for that model it re-creates the shipped weights rather than losing more precision.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


ROW_CHUNK = 256  # larger steps run in chunks of this many rows (measured: 0-12% slower)


def row_bucket(rows: int) -> int:
    """The row count a oneDNN call pads `rows` (<= ROW_CHUNK) to: exact up to 16, where
    reading the weights bounds the time, then 8 sizes an octave (<= 12.5% padding)."""
    if rows <= 16:
        return rows
    step = 1 << ((rows - 1).bit_length() - 4)
    return -(-rows // step) * step


def _pointwise(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    rows = x.shape[0]
    if rows > ROW_CHUNK:
        return torch.cat([_pointwise(part, weight, bias) for part in x.split(ROW_CHUNK)])
    padded = row_bucket(rows)
    if padded != rows:
        x = F.pad(x, (0, 0, 0, padded - rows))  # zero rows
    y = torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return y if padded == rows else y[:rows]


class PackedLinear(nn.Module):
    """y = x @ W^T (+ bias) with W pre-packed for oneDNN on CPU, in W's dtype. For a bf16 W
    with `fp32_rows` > 0, inputs of at least that many rows multiply a packed float32 copy of
    W (the bf16 values, exactly) and round the float32 result to bf16 once; where oneDNN has
    no bf16 kernels (plain AVX2) every input does."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 fp32_rows: int = 0) -> None:
        super().__init__()
        w = weight.detach().contiguous()
        bf16 = w.dtype == torch.bfloat16
        emulated = bf16 and not bf16_kernels()  # oneDNN refuses bf16 here: always the copy
        self.fp32_rows = 1 if emulated else fp32_rows if bf16 else 0
        self.bias = None if bias is None else bias.detach()
        self.register_buffer("weight32", torch.ops.mkldnn._reorder_linear_weight(
            w.float(), 64) if self.fp32_rows > 0 else None)
        self.bias32 = None if bias is None or self.fp32_rows <= 0 else self.bias.float()
        # The batch-size hint picks oneDNN's layout: a float32 weight packed for one row runs
        # 2-5 rows at half speed (measured on AVX2), one packed for 64 loses nothing at one.
        hint = 1 if bf16 else 64
        self.register_buffer("weight", self.weight32 if emulated else
                             torch.ops.mkldnn._reorder_linear_weight(w, hint))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight32 is not None and x.shape[0] >= self.fp32_rows:
            return _pointwise(x.float(), self.weight32, self.bias32).to(x.dtype)
        return _pointwise(x, self.weight, self.bias)


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


class Int4Linear(nn.Module):
    """Weight-only int4 for steps of few rows, a PackedLinear for the rest. With `ext` (tidal's
    C++ extension) the few rows run its `int4_linear`: activations rounded to int8 per group
    and integer products, as llama.cpp does (2x torch's kernel on AVX2); without, torch's
    int4 kernel, which vectorises bf16 activations only. Either reads a third of the bytes
    and wins at one row but computes slowly: `max_rows` is where the dense layer takes over
    (measured: torch's kernel loses from about 8 rows on, tidal's from about 16)."""

    GROUP = 32

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 fp32_rows: int = 0, ext: Any = None) -> None:
        super().__init__()
        n, k = weight.shape
        if k % self.GROUP or n % 16:  # the kernel's packing needs both
            raise ValueError(f"int4 needs in_features divisible by {self.GROUP} and "
                             f"out_features by 16; got {k} and {n}")
        groups = weight.detach().float().view(n, k // self.GROUP, self.GROUP)
        lo, hi = groups.amin(-1), groups.amax(-1)
        scale = ((hi - lo) / 15).clamp(min=1e-8)
        q = torch.round((groups - lo[..., None]) / scale[..., None]).clamp(0, 15).to(torch.uint8)
        self.ext = ext
        self.max_rows = 8 if ext is not None else 4
        if ext is not None:  # element i of a group in byte i's low nibble, i + 16 in its high
            self.register_buffer("packed", (q[..., :16] | (q[..., 16:] << 4)).view(n, k // 2))
            self.register_buffer("scales_zeros", torch.stack([scale, lo], -1).half())
        else:
            self.register_buffer("packed", torch._convert_weight_to_int4pack_for_cpu(
                q.to(torch.int32).view(n, k), 1))
            # That kernel computes (q - 8) * scale + zero with [k / GROUP, n, 2] scales, zeros.
            self.register_buffer("scales_zeros", torch.stack([scale, lo + 8 * scale], -1)
                                 .transpose(0, 1).contiguous().to(weight.dtype))
        self.bias = None if bias is None else bias.detach()
        self.dense = PackedLinear(weight, bias, fp32_rows)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > self.max_rows:
            return self.dense(x)
        if self.ext is not None:
            return self.ext.int4_linear(x, self.packed, self.scales_zeros, self.bias)
        y = torch._weight_int4pack_mm_for_cpu(x, self.packed, self.GROUP, self.scales_zeros)
        return y if self.bias is None else y + self.bias


@functools.cache
def cpuinfo(field: str) -> str:
    """The first value of `field` in /proc/cpuinfo ('' where it cannot be read); read once,
    as every linear layer built asks."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
    line = next((ln for ln in text.splitlines() if ln.split(":")[0].strip() == field), "")
    return line.partition(":")[2].strip()


@functools.cache
def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags (empty where /proc/cpuinfo cannot be read)."""
    return frozenset(cpuinfo("flags").split())


def bf16_gemms_win() -> bool:
    """Whether oneDNN's bf16 GEMMs outrun its float32 ones on this CPU: with AMX tiles, or
    AVX512-BF16 on AMD (Zen 4 on, whose vdpbf16ps does twice an FMA's work a cycle: a 2-core
    Zen 4 multiplies 2048x2048 by 2,048 rows in 75 ms in bf16, 150 in float32). Not Intel's
    AVX512-BF16 without AMX (a 2-core Xeon: bf16 85 against float32 160 GFLOP/s a core)."""
    flags = cpu_flags()
    return "amx_bf16" in flags or ("avx512_bf16" in flags
                                   and cpuinfo("vendor_id") == "AuthenticAMD")


def default_fp32_rows() -> int:
    """16 rows where oneDNN's bf16 GEMM is the slower one (measured crossover 8-16 rows on a
    Xeon without AMX); 0 (never) where it wins (bf16_gemms_win)."""
    return 0 if bf16_gemms_win() else 16


def can_pack(dtype: torch.dtype, device: str) -> bool:
    """oneDNN packing pays (and keeps results bit-identical) for bf16 and float32 on CPU."""
    return (device == "cpu" and dtype in (torch.bfloat16, torch.float32)
            and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


def bf16_kernels() -> bool:
    """Whether this CPU's oneDNN runs bf16 matmuls (it refuses them on plain AVX2)."""
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def replace_linears(model: nn.Module, kind: type[nn.Module], **options: Any) -> nn.Module:
    """Swap every projection for `kind(weight, bias, **options)`; a tied LM head gets its own
    converted copy of the embedding (the embedding itself stays a lookup table)."""
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                setattr(module, name, kind(child.weight, child.bias, **options))
    if getattr(model, "lm_head", False) is None and hasattr(model, "embed_tokens"):
        model.lm_head = kind(model.embed_tokens.weight, **options)
    return model


def products(proj: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """proj(x), left in bf16 where a GGUF projection's bf16 tiles computed it (GGUFLinear's
    bf16_out): for the fused ops, which read bf16 products as they read their float32 copy."""
    return proj(x, bf16_out=True) if getattr(proj, "takes_bf16_out", False) else proj(x)
