"""Batched LoRA deltas in Triton: `lora_add(x, y, a, b, rows, ends, bounds)` takes the
arguments of the C++ `lora_add` (csrc/lora.cpp) and does what it does, in place: for each
listed row i of slot s (rows grouped by slot, `ends` the slots' cumulative counts),
y[rows[i]] += (x[rows[i]] A_s^T) B_s^T, with A [S, R, k] and B transposed, [S, R, n]; part p
of a fused projection (its columns up to bounds[p]) reads its own R/P ranks of B alone.

One program computes one row's delta on BLOCK_N output columns: the shrink (R dot products
over k, in float32) and then the expand of those columns over the part's ranks. Decode
steps have few rows, so the shrink each column block repeats costs little; the products
run on CUDA cores (R is far below a tensor-core tile's worth of rows per adapter).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tidal.model.kernels.norm import cast_rtne


@triton.jit
def _lora_kernel(x_ptr, y_ptr, a_ptr, b_ptr, rows_ptr, ends_ptr, bounds_ptr, k, n, r,
                 num_slots, PARTS: tl.constexpr, BLOCK_K: tl.constexpr,
                 BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr):
    i = tl.program_id(0)
    row = tl.load(rows_ptr + i).to(tl.int64)
    s = i.to(tl.int64) * 0  # the listed row's slot: how many slots end at or before it
    for q in range(num_slots):
        s += (tl.load(ends_ptr + q) <= i).to(tl.int64)
    ranks = tl.arange(0, BLOCK_R)
    live = ranks < r
    u = tl.zeros([BLOCK_R], dtype=tl.float32)
    for k0 in range(0, k, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        xv = tl.load(x_ptr + row * k + ks, mask=ks < k, other=0.0).to(tl.float32)
        av = tl.load(a_ptr + (s * r + ranks[:, None]) * k + ks[None, :],
                     mask=live[:, None] & (ks[None, :] < k), other=0.0).to(tl.float32)
        u += tl.sum(av * xv[None, :], axis=1)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    inside = cols < n
    part = tl.zeros([BLOCK_N], dtype=tl.int32)  # each column's part: bounds it has passed
    for p in range(PARTS - 1):
        part += (cols >= tl.load(bounds_ptr + p)).to(tl.int32)
    own = (ranks[:, None] // (r // PARTS)) == part[None, :]
    bv = tl.load(b_ptr + (s * r + ranks[:, None]) * n + cols[None, :],
                 mask=live[:, None] & inside[None, :] & own, other=0.0).to(tl.float32)
    d = tl.sum(u[:, None] * bv, axis=0)
    yv = tl.load(y_ptr + row * n + cols, mask=inside, other=0.0)
    tl.store(y_ptr + row * n + cols, cast_rtne(yv.to(tl.float32) + d, y_ptr.dtype.element_ty),
             mask=inside)


def lora_add(x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
             rows: torch.Tensor, ends: torch.Tensor, bounds: torch.Tensor) -> None:
    """y[rows] += each row's adapter delta, in place (see the module's docstring)."""
    m = rows.numel()
    if m == 0:
        return
    k, n, r = x.shape[1], y.shape[1], a.shape[1]
    block_n = 64
    _lora_kernel[(m, triton.cdiv(n, block_n))](
        x, y, a, b, rows, ends, bounds, k, n, r, ends.numel(), PARTS=bounds.numel(),
        BLOCK_K=64, BLOCK_R=triton.next_power_of_2(r), BLOCK_N=block_n)
