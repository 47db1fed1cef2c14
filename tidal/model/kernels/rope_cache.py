"""Rotary embedding of q and k fused with the KV cache write, in Triton.

`rope_and_cache(qk, v, cos, sin, k_cache, v_cache, slot_mapping, num_q_heads)` stands in
for `apply_rope(qk, (cos, sin))` (tidal.model.llama) followed by the backend's
`k_cache.view(-1, Hkv, D).index_copy_(0, slot_mapping, k)` and the same for v
(TorchAttention.forward): qk [T, H + Hkv, D], the q heads then the k heads; v [T, Hkv, D];
cos and sin [T, 1, R] (or [T, R]) as `Rotary.tables` gives them, R <= D rotary dims with the
sine signed for the half-split pairing, x*cos + roll(x, R/2)*sin on the first R dims and the
rest unchanged; caches [num_blocks, block_size, Hkv, D]; slot_mapping [T] of
block * block_size + offset, where a negative slot (padding) writes nothing.

It returns (q, k), the rotated heads, as views of one new [T, H + Hkv, D] tensor, or of
`out` when given: `out=qk` rotates in place (each program reads all of its heads before it
writes them, so that is safe). Each program takes one token and a block of its heads; the
k heads' programs also write that token's k and v into the caches.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tidal.model.kernels.norm import cast_rtne


@triton.jit
def _rope_cache_kernel(qk_ptr, v_ptr, cos_ptr, sin_ptr, out_ptr, kc_ptr, vc_ptr, slot_ptr,
                       sx_t, sx_h, sv_t, sv_h, sc_t, ss_t, so_t, so_h,
                       skc_n, skc_b, skc_h, svc_n, svc_b, svc_h,
                       NUM_Q: tl.constexpr, NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                       DIM_PAD: tl.constexpr, ROT: tl.constexpr, HEADS: tl.constexpr,
                       BLOCK_SIZE: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)  # t * stride overflows int32 on long prompts
    heads = tl.program_id(1) * HEADS + tl.arange(0, HEADS)
    d = tl.arange(0, DIM_PAD)
    mask = (heads[:, None] < NUM_HEADS) & (d[None, :] < HEAD_DIM)
    rot = d < ROT
    # roll(x, R/2) on the first R dims: dim i reads dim i + R/2 (first half), i - R/2
    partner = tl.where(d < ROT // 2, d + ROT // 2, d - ROT // 2)
    row = qk_ptr + t * sx_t + heads[:, None] * sx_h
    x = tl.load(row + d[None, :], mask=mask, other=0.0)
    x_roll = tl.load(row + partner[None, :], mask=mask & rot[None, :], other=0.0)
    cos = tl.load(cos_ptr + t * sc_t + d, mask=rot, other=0.0)
    sin = tl.load(sin_ptr + t * ss_t + d, mask=rot, other=0.0)
    # x*cos + x_roll*sin rounded where PyTorch rounds: each product, then the sum
    odt = out_ptr.dtype.element_ty
    a = cast_rtne(x.to(tl.float32) * cos.to(tl.float32)[None, :], odt).to(tl.float32)
    b = cast_rtne(x_roll.to(tl.float32) * sin.to(tl.float32)[None, :], odt).to(tl.float32)
    y = tl.where(rot[None, :], cast_rtne(a + b, odt), x.to(odt))
    tl.store(out_ptr + t * so_t + heads[:, None] * so_h + d[None, :], y, mask=mask)
    slot = tl.load(slot_ptr + t)
    # blocks with k heads cache them, unless the token is padding (a negative slot)
    if (tl.program_id(1) * HEADS + HEADS > NUM_Q) & (slot >= 0):
        kvh = heads - NUM_Q  # negative for q heads: masked off
        kv_mask = mask & (heads[:, None] >= NUM_Q)
        page, offset = slot // BLOCK_SIZE, slot % BLOCK_SIZE
        tl.store(kc_ptr + page * skc_n + offset * skc_b + kvh[:, None] * skc_h + d[None, :],
                 y.to(kc_ptr.dtype.element_ty), mask=kv_mask)
        val = tl.load(v_ptr + t * sv_t + kvh[:, None] * sv_h + d[None, :], mask=kv_mask,
                      other=0.0)
        tl.store(vc_ptr + page * svc_n + offset * svc_b + kvh[:, None] * svc_h + d[None, :],
                 val.to(vc_ptr.dtype.element_ty), mask=kv_mask)


def _unit_last(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def rope_and_cache(qk: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                   num_q_heads: int, out: torch.Tensor | None = None,
                   heads_per_program: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(q [T, H, D], k [T, Hkv, D]) rotated, views of `out` (a new tensor, or `out=qk` to
    rotate in place), after writing the rotated k and v into the caches at `slot_mapping`
    (negative slots skipped). `heads_per_program` (a power of two) tiles the heads; by
    default ~2k elements a program."""
    tokens, num_heads, dim = qk.shape
    kv_heads = num_heads - num_q_heads
    _, block_size, cache_heads, cache_dim = k_cache.shape
    if (kv_heads, dim) != (cache_heads, cache_dim) or v.shape != (tokens, kv_heads, dim):
        raise ValueError(f"qk {tuple(qk.shape)} with {num_q_heads} q heads, v "
                         f"{tuple(v.shape)} do not match the cache's {cache_heads} heads "
                         f"of {cache_dim}")
    rot = cos.shape[-1]
    if rot > dim or rot % 2:
        raise ValueError(f"{rot} rotary dims for heads of {dim}")
    qk, v = _unit_last(qk), _unit_last(v)
    cos = _unit_last(cos.reshape(tokens, rot))
    sin = _unit_last(sin.reshape(tokens, rot))
    slot_mapping = slot_mapping.contiguous()
    if out is None:
        # apply_rope's result dtype: a float32 table promotes bf16 heads to float32
        out = torch.empty(qk.shape, device=qk.device,
                          dtype=torch.promote_types(qk.dtype, cos.dtype))
    elif out.shape != qk.shape or out.stride(-1) != 1:
        raise ValueError(f"out {tuple(out.shape)} for qk {tuple(qk.shape)}")
    q_out, k_out = out[:, :num_q_heads], out[:, num_q_heads:]
    if tokens == 0:
        return q_out, k_out
    dim_pad = triton.next_power_of_2(dim)
    heads = heads_per_program or max(1, min(triton.next_power_of_2(num_heads),
                                            2048 // dim_pad))
    if heads & (heads - 1):
        raise ValueError(f"{heads} heads a program is not a power of two")
    _rope_cache_kernel[(tokens, triton.cdiv(num_heads, heads))](
        qk, v, cos, sin, out, k_cache, v_cache, slot_mapping,
        qk.stride(0), qk.stride(1), v.stride(0), v.stride(1), cos.stride(0), sin.stride(0),
        out.stride(0), out.stride(1), *k_cache.stride()[:3], *v_cache.stride()[:3],
        NUM_Q=num_q_heads, NUM_HEADS=num_heads, HEAD_DIM=dim, DIM_PAD=dim_pad, ROT=rot,
        HEADS=heads, BLOCK_SIZE=block_size)
    return q_out, k_out
