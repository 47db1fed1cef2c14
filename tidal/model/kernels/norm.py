"""RMSNorm in Triton, alone or fused with the residual add before it.

`fused_add_rms_norm(x, residual, weight, eps)` is a decoder layer's `h = h + a` followed by
the next RMSNorm in one pass over the row: it returns (normed, residual_out) with
residual_out = x + residual in x's dtype and normed = RMSNorm(residual_out), the very
formula of `tidal.model.llama.RMSNorm.forward` (Llama's, not Gemma's offset one): normalise
in float32, cast to the model's dtype, then scale by the weight in the model's dtype.
`rms_norm(x, weight, eps)` is the same kernel without the add. Both write new tensors (the
inputs are left as they are). One program normalises one row of any width (the tail past a
power of two is masked), so a row must fit in a program: fine for hidden sizes to ~16k.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def cast_rtne(x, dtype: tl.constexpr):
    """float32 x cast to `dtype`, to bf16 rounding to nearest even by hand: the GPU's cast
    does so, Triton's interpreter truncates, and the tests compare bit for bit under it."""
    if dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16  # then truncating is exact
        x = tl.where(x != x, x, bits.to(tl.float32, bitcast=True))  # NaN stays NaN
    return x.to(dtype)


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, eps, n_cols,
                     sx, sr, so, sro, HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # row * stride overflows int32 on long prompts
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    h = tl.load(x_ptr + row * sx + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * sr + cols, mask=mask, other=0.0)
        # PyTorch adds two bf16 tensors in float32 and rounds once: so do we
        h = cast_rtne(h.to(tl.float32) + r.to(tl.float32), x_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * sro + cols, h, mask=mask)
    h32 = h.to(tl.float32)
    mean_sq = tl.sum(h32 * h32, axis=0) / n_cols  # masked tail loads 0: adds nothing
    normed = cast_rtne(h32 * tl.rsqrt(mean_sq + eps), x_ptr.dtype.element_ty)  # .to(x.dtype)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    # weight * normed in the model's dtype: one product in float32, one rounding
    out = w.to(tl.float32) * normed.to(tl.float32)
    tl.store(out_ptr + row * so + cols, cast_rtne(out, out_ptr.dtype.element_ty), mask=mask)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as [rows, hidden] with unit stride along the row (a view where it can be)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _launch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
            eps: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    hidden = x.shape[-1]
    if weight.shape != (hidden,):
        raise ValueError(f"weight of shape {tuple(weight.shape)} for rows of {hidden}")
    x2, weight = _rows(x), weight.contiguous()
    # weight * normed promotes as PyTorch does (a float32 weight on bf16 rows gives float32)
    out = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype),
                      device=x.device)
    out2 = out.view(-1, hidden)
    if residual is not None:
        if residual.shape != x.shape or residual.dtype != x.dtype:
            raise ValueError(f"residual {tuple(residual.shape)} {residual.dtype} does not "
                             f"match x {tuple(x.shape)} {x.dtype}")
        r2 = _rows(residual)
        res_out = torch.empty_like(x, memory_format=torch.contiguous_format)
        ro2 = res_out.view(-1, hidden)
    else:
        r2, res_out, ro2 = x2, None, out2  # never read nor written: HAS_RESIDUAL is off
    rows = x2.shape[0]
    if rows == 0:
        return out, res_out
    block = triton.next_power_of_2(hidden)
    _rms_norm_kernel[(rows,)](
        x2, r2, weight, out2, ro2, eps, hidden,
        x2.stride(0), r2.stride(0), out2.stride(0), ro2.stride(0),
        HAS_RESIDUAL=residual is not None, BLOCK=block,
        num_warps=min(max(block // 256, 1), 16))  # ~8 elements a thread
    return out, res_out


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(x + residual), x + residual), both new tensors of x's shape; x and residual
    [..., hidden] of one dtype, weight [hidden]. Equals `h = x + residual` then
    `RMSNorm.forward(h)` (llama.py, not Gemma's offset form)."""
    normed, res_out = _launch(x, residual, weight, eps)
    assert res_out is not None
    return normed, res_out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm(x) as a new tensor: x [..., hidden], weight [hidden]; equals
    `RMSNorm.forward` (llama.py, not Gemma's offset form)."""
    return _launch(x, None, weight, eps)[0]
