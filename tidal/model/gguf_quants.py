"""GGUF tensors in their own formats: no float32 copy of a quantized weight.

`QuantizedWeight` holds one tensor's blocks as bytes (a view of the file's memory map where
it can) and `GGUFLinear` multiplies by them: steps of a few rows through the C++ kernels
(`csrc/gguf_quants.cpp`: activations rounded to int8 per 32 and integer dot products, as
ggml does; a decode step reads every weight once, so reading 4-8 bits a weight instead of
16-32 is the speed-up), larger ones through tiles of dequantized rows that oneDNN multiplies,
so the extra memory stays one tile however large the weight.
"""

from __future__ import annotations

import warnings
from types import ModuleType
from typing import Any

import gguf
import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as QT
from gguf.constants import GGML_QUANT_SIZES
from torch import nn

from tidal.model.linear import cpu_flags

FLOAT_TYPES = {QT.F32: torch.float32, QT.F16: torch.float16, QT.BF16: torch.bfloat16}
# Each block format's fields, bytes each, in the block's order (ggml's block structs).
BLOCK_FIELDS = {
    QT.Q8_0: (2, 32),               # d, qs
    QT.Q4_0: (2, 16),               # d, qs
    QT.Q4_1: (2, 2, 16),            # d, m, qs
    QT.Q5_0: (2, 4, 16),            # d, qh, qs
    QT.Q5_1: (2, 2, 4, 16),         # d, m, qh, qs
    QT.Q4_K: (2, 2, 12, 128),       # d, dmin, scales, qs
    QT.Q5_K: (2, 2, 12, 32, 128),   # d, dmin, scales, qh, qs
    QT.Q6_K: (128, 64, 16, 2),      # ql, qh, scales, d
}
SUPPORTED = frozenset(FLOAT_TYPES) | frozenset(BLOCK_FIELDS)
# Formats whose kernels run faster planar (15-25% at one row, benchmarks/gguf_kernels.py);
# the others run as fast (Q6_K faster) in the file's layout, so they stay views of the file.
PLANAR = frozenset({QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1})
MAX_ROWS = 16  # the integer kernel's crossover with dequantized tiles: 16-32 rows, measured
TILE_BYTES = 4 << 20  # float32 bytes of a dequantized tile (256-1024 rows; measured best)


def _extension() -> ModuleType | None:
    from tidal.model import cpu_decode  # only here: cpu_decode builds on first use

    return cpu_decode.extension()


class QuantizedWeight:
    """One GGUF tensor of logical shape [out_features, in_features] in its own format.

    `data` is any array of the tensor's bytes as the file holds them (a numpy memmap from
    gguf.GGUFReader: the weight then stays a view of the file unless repacked). With
    `planar` (None: for the formats in PLANAR) each row is repacked so each block field
    (scales, quants, high bits) lies in a plane of its own: contiguous quants and aligned
    scales for the kernels, in exactly the file's bytes (`nbytes`), never floats. A type
    outside SUPPORTED raises ValueError naming the tensor and its type.
    """

    def __init__(self, name: str, data: Any, qtype: int | QT, shape: tuple[int, int],
                 planar: bool | None = None, use_extension: bool = True) -> None:
        try:
            qtype = QT(qtype)
        except ValueError:
            raise ValueError(f"GGUF tensor {name!r} has unknown ggml type {qtype}") from None
        if qtype not in SUPPORTED:
            raise ValueError(f"GGUF tensor {name!r} has type {qtype.name}, which tidal does not "
                             f"run; it runs {', '.join(sorted(t.name for t in SUPPORTED))}")
        n, k = (int(d) for d in shape)
        block, size = GGML_QUANT_SIZES[qtype]
        if k % block:
            raise ValueError(f"GGUF tensor {name!r} ({qtype.name}): in_features {k} is not a "
                             f"multiple of its block of {block}")
        raw = _as_bytes(data)
        if raw.numel() != n * (k // block) * size:
            raise ValueError(f"GGUF tensor {name!r} ({qtype.name}, {n}x{k}) needs "
                             f"{n * (k // block) * size} bytes, got {raw.numel()}")
        self.name, self.qtype, self.shape = name, qtype, (n, k)
        self.ext = _extension() if use_extension else None
        self.planar = qtype in BLOCK_FIELDS and (qtype in PLANAR if planar is None else planar)
        rows = raw.view(n, -1)
        if qtype in FLOAT_TYPES:
            self.data = rows.view(FLOAT_TYPES[qtype])
        else:
            self.data = _to_planes(rows, BLOCK_FIELDS[qtype]) if self.planar else rows

    @property
    def nbytes(self) -> int:
        """Bytes this weight holds (for block formats, those of the file's blocks)."""
        return self.data.numel() * self.data.element_size()

    def dequantize_rows(self, start: int, stop: int, dtype: torch.dtype = torch.float32,
                        out: torch.Tensor | None = None) -> torch.Tensor:
        """Rows start..stop of the weight as a [stop - start, in_features] float tensor,
        written into `out` (contiguous, of that shape and dtype) when given."""
        rows, k = stop - start, self.shape[1]
        if out is None:
            out = torch.empty(rows, k, dtype=dtype)
        if self.qtype in FLOAT_TYPES:
            return out.copy_(self.data[start:stop])
        if self.ext is not None and out.dtype in (torch.float32, torch.bfloat16):
            self.ext.gguf_dequantize(self.data, int(self.qtype), self.planar, start, out)
            return out
        blocks = self.data[start:stop]
        if self.planar:
            blocks = _from_planes(blocks, BLOCK_FIELDS[self.qtype])
        values = gguf.quants.dequantize(blocks.numpy(), self.qtype)
        return out.copy_(torch.from_numpy(values))

    def __repr__(self) -> str:
        return f"QuantizedWeight({self.name!r}, {self.qtype.name}, {list(self.shape)})"


def _as_bytes(data: Any) -> torch.Tensor:
    """The array's bytes as a flat uint8 tensor, sharing its memory."""
    if isinstance(data, torch.Tensor):
        return data.contiguous().view(-1).view(torch.uint8)
    arr = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    with warnings.catch_warnings():  # a read-only memmap: the weights are never written
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(arr)


def _to_planes(rows: torch.Tensor, sizes: tuple[int, ...]) -> torch.Tensor:
    """[n, blocks * block_bytes] as the file holds them -> each field in a plane of the row
    (the planes in field order), one strided copy a field and no temporaries."""
    n, block_bytes = rows.shape[0], sum(sizes)
    blocks = rows.view(n, -1, block_bytes)
    nb = blocks.shape[1]
    out = torch.empty_like(rows)
    at = 0
    for size in sizes:
        field_at = at // nb
        out[:, at:at + nb * size].view(n, nb, size).copy_(blocks[:, :, field_at:field_at + size])
        at += nb * size
    return out


def _from_planes(rows: torch.Tensor, sizes: tuple[int, ...]) -> torch.Tensor:
    """The inverse of _to_planes: rows back in the file's block layout."""
    n, block_bytes = rows.shape[0], sum(sizes)
    nb = rows.shape[1] // block_bytes
    out = torch.empty(n, nb, block_bytes, dtype=torch.uint8)
    at = 0
    for size in sizes:
        out[:, :, at // nb:at // nb + size] = rows[:, at:at + nb * size].reshape(n, nb, size)
        at += nb * size
    return out.view(n, -1)


class GGUFLinear(nn.Module):
    """y = x @ W^T (+ bias) for a QuantizedWeight W. Steps of at most `max_rows` rows run
    the C++ integer kernel (block formats, with the extension built); larger ones (and
    every step without the extension) multiply tiles of W dequantized `tile_rows` output
    rows at a time, in bf16 for bf16 inputs on CPUs with AMX, else in float32."""

    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None = None,
                 max_rows: int = MAX_ROWS, tile_rows: int | None = None) -> None:
        super().__init__()
        self.weight = weight
        self.bias = None if bias is None else bias.detach()
        n, k = weight.shape
        self.in_features, self.out_features = k, n
        self.max_rows = max_rows if weight.ext is not None else 0
        self.tile_rows = tile_rows or min(1024, max(256, TILE_BYTES // (4 * k) // 16 * 16))
        self.bf16_tiles = "amx_bf16" in cpu_flags()  # else oneDNN's bf16 GEMM lags float32

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        w = self.weight
        if w.qtype in FLOAT_TYPES and w.data.dtype == x.dtype:
            y = F.linear(x2, w.data, self.bias)
        elif (w.qtype in BLOCK_FIELDS and x2.shape[0] <= self.max_rows
              and x.dtype in (torch.float32, torch.bfloat16)):
            bias = None if self.bias is None else self.bias.to(x.dtype)
            y = w.ext.gguf_linear(x2, w.data, int(w.qtype), w.planar, bias)
        else:
            y = self._tiled(x2)
        return y.view(*lead, self.out_features)

    def _tiled(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype if x.dtype == torch.bfloat16 and self.bf16_tiles else torch.float32
        xs = x.to(dtype)
        n, step = self.out_features, self.tile_rows
        y = torch.empty(x.shape[0], n, dtype=dtype)
        tile = torch.empty(min(step, n), self.in_features, dtype=dtype)
        for a in range(0, n, step):
            b = min(n, a + step)
            w = self.weight.dequantize_rows(a, b, dtype, out=tile[:b - a])
            y[:, a:b] = F.linear(xs, w)
        if self.bias is not None:
            y += self.bias.to(dtype)
        return y.to(x.dtype)

    def extra_repr(self) -> str:
        return (f"{self.weight.name}: {self.weight.qtype.name}, in_features={self.in_features}, "
                f"out_features={self.out_features}, max_rows={self.max_rows}")
