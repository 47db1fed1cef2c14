"""Paged decode attention in Triton: one query token per sequence against its context, read
in place from the paged KV cache, split along the context (flash-decoding) so that a few
long sequences still fill the GPU.

`paged_decode_attention(q, k_cache, v_cache, tables, lens, scale, window=0)` has the C++ CPU
kernel's signature and layouts: q [B, H, D]; caches [num_blocks, block_size, Hkv, D];
tables [B, max_blocks] block ids; lens [B] context lengths (the new token's included);
`window` > 0 attends to the last `window` tokens only. Each program takes one sequence, one
KV head with the query heads that share it (GQA), and one split of the context, keeping an
online softmax over its blocks; a second pass merges the splits by their log-sum-exp.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _split_kernel(q_ptr, k_ptr, v_ptr, tables_ptr, lens_ptr, out_ptr, lse_ptr,
                  scale, window, split_blocks,
                  sq_b, sq_h, sk_n, sk_t, sk_h, sv_n, sv_t, sv_h, st_b, so_b, so_h, so_s,
                  sl_b, sl_h,
                  GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
                  DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    b, kvh, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    n = tl.load(lens_ptr + b)
    first = tl.maximum(n - window, 0)  # window: a huge number for whole contexts
    start = tl.maximum(split * split_blocks * BLOCK_SIZE, first)
    end = tl.minimum((split + 1) * split_blocks * BLOCK_SIZE, n)
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, DIM_PAD)
    heads = kvh * GROUP + g
    q_mask = (g[:, None] < GROUP) & (d[None, :] < HEAD_DIM)
    q = tl.load(q_ptr + b * sq_b + heads[:, None] * sq_h + d[None, :], mask=q_mask,
                other=0.0).to(tl.float32)
    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    s = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, DIM_PAD], tl.float32)
    t_in = tl.arange(0, BLOCK_SIZE)
    for blk in range(start // BLOCK_SIZE, tl.cdiv(end, BLOCK_SIZE)):  # this split's blocks
        page = tl.load(tables_ptr + b * st_b + blk).to(tl.int64)
        t = blk * BLOCK_SIZE + t_in
        valid = (t >= start) & (t < end)
        kv_mask = valid[:, None] & (d[None, :] < HEAD_DIM)
        k = tl.load(k_ptr + page * sk_n + t_in[:, None] * sk_t + kvh * sk_h + d[None, :],
                    mask=kv_mask, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + page * sv_n + t_in[:, None] * sv_t + kvh * sv_h + d[None, :],
                    mask=kv_mask, other=0.0).to(tl.float32)
        scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale  # [GROUP_PAD, BLOCK]
        scores = tl.where(valid[None, :], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a split with no token yet
        p = tl.exp(scores - m_safe[:, None])
        alpha = tl.exp(m - m_safe)
        s = s * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        m = m_new
    lse = tl.where(s > 0, m + tl.log(tl.maximum(s, 1e-30)), float("-inf"))  # padded rows: 0
    out = acc / tl.where(s > 0, s, 1.0)[:, None]
    tl.store(out_ptr + b * so_b + heads[:, None] * so_h + split * so_s + d[None, :], out,
             mask=q_mask)
    tl.store(lse_ptr + b * sl_b + heads * sl_h + split, lse, mask=g < GROUP)


def num_splits(max_len: int, block_size: int, max_splits: int = 16,
               tokens_per_split: int = 512) -> tuple[int, int]:
    """(splits, tokens a split covers, a whole number of blocks) for contexts up to
    `max_len`: one split per `tokens_per_split` tokens, at most `max_splits`."""
    splits = max(1, min(max_splits, triton.cdiv(max_len, tokens_per_split)))
    per = triton.cdiv(triton.cdiv(max_len, splits), block_size) * block_size
    return triton.cdiv(max_len, per), per


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           tables: torch.Tensor, lens: torch.Tensor, scale: float,
                           window: int = 0, max_len: int | None = None) -> torch.Tensor:
    """Attention of each sequence's one query token over its paged context, [B, H, D] in
    q's dtype. `max_len` (the longest context) sizes the splits; by default the block
    table's width bounds it, which needs no device-to-host copy of `lens`."""
    q, tables, lens = q.contiguous(), tables.contiguous(), lens.contiguous()  # unit strides
    batch, heads, dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads are not a multiple of the cache's "
                         f"{kv_heads} KV heads")
    if max_len is None:
        max_len = tables.shape[1] * block_size
    splits, per = num_splits(max(max_len, 1), block_size)
    out = torch.empty(batch, heads, splits, dim, dtype=torch.float32, device=q.device)
    lse = torch.empty(batch, heads, splits, dtype=torch.float32, device=q.device)
    group = heads // kv_heads
    _split_kernel[(batch, kv_heads, splits)](
        q, k_cache, v_cache, tables, lens, out, lse, scale, window if window > 0 else 2**30,
        per // block_size,
        q.stride(0), q.stride(1), *k_cache.stride()[:3], *v_cache.stride()[:3],
        tables.stride(0), out.stride(0), out.stride(1), out.stride(2),
        lse.stride(0), lse.stride(1),
        GROUP=group, GROUP_PAD=triton.next_power_of_2(group), HEAD_DIM=dim,
        DIM_PAD=triton.next_power_of_2(dim), BLOCK_SIZE=block_size)
    # merge the splits: each weighs by exp(its lse - the total's); empty splits weigh 0
    total = torch.logsumexp(lse, dim=2, keepdim=True)
    weights = torch.exp(lse - total).nan_to_num(0.0)
    return (out * weights[..., None]).sum(dim=2).to(q.dtype)
