"""Paged decode attention in Triton: one query token per sequence against its context, read
in place from the paged KV cache, split along the context (flash-decoding) so that a small
batch still fills the GPU.

`paged_decode_attention(q, k_cache, v_cache, tables, lens, scale, window=0)` has the C++ CPU
kernel's signature and layouts: q [B, H, D]; caches [num_blocks, block_size, Hkv, D], or of
int8 / float8_e4m3fn rows of D codes and a float16 scale (tidal.model.kv_quant: each tile's
scores take their keys' scales after the product, its weights their values' before);
tables [B, max_blocks] block ids; lens [B] context lengths (the new token's included);
`window` > 0 attends to the last `window` tokens only; `tree` [B, 2] int64 (optional): a
speculation tree row's (start, bits), of the positions from start on only those whose bit is
set (`tidal/spec/tree.py`).

Each program takes one sequence, one KV head with the query heads that share it (GQA, padded
to the 16 rows a tensor-core product needs), and one split of the context. It walks the split
in tiles of tokens that may span several blocks (each token finds its block in the table, so
a tile's loads are in flight together) with an online softmax. A second kernel merges the
splits by their log-sum-exp. A split's length depends only on the batch and the heads, never
on `lens` or the table's width: a step needs no sync, and a CUDA graph's wider table splits
and sums a context exactly as an eager step does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tidal.model.kv_quant import CODES, SCALE_STEPS as STEPS

MIN_SPLIT_TOKENS = 64  # a split's length while few sequences run
PROGRAMS_PER_MIN_SPLIT = 32  # past this many (sequence, KV head) programs, splits double
MERGE_CHUNK = 16  # splits merged per step of the merge kernel's loop
CODED_DTYPES = tuple(CODES.values())  # caches of quantized rows
SCALE_STEPS = tl.constexpr(STEPS)  # a row's float16 scale counts 1 / SCALE_STEPS units


@triton.jit
def _split_kernel(q_ptr, k_ptr, v_ptr, tables_ptr, lens_ptr, tree_ptr, out_ptr, lse_ptr,
                  scale, window, split_tokens,
                  sq_b, sq_h, sk_n, sk_t, sk_h, sv_n, sv_t, sv_h, st_b, so_b, so_h, so_s,
                  sl_b, sl_h,
                  GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
                  DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr,
                  FP32_DOT: tl.constexpr, TREE: tl.constexpr, CODED: tl.constexpr):
    b, kvh, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    n = tl.load(lens_ptr + b)
    if TREE:
        tree_start = tl.load(tree_ptr + 2 * b)
        tree_bits = tl.load(tree_ptr + 2 * b + 1)
    first = tl.maximum(n - window, 0)  # window: a huge number for whole contexts
    start = tl.maximum(split * split_tokens, first)
    end = tl.minimum((split + 1) * split_tokens, n)
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, DIM_PAD)
    heads = kvh * GROUP + g
    q_mask = (g[:, None] < GROUP) & (d[None, :] < HEAD_DIM)
    dot_type = tl.float32 if FP32_DOT else q_ptr.dtype.element_ty  # codes convert exactly
    q = tl.load(q_ptr + b * sq_b + heads[:, None] * sq_h + d[None, :], mask=q_mask,
                other=0.0).to(dot_type)
    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    s = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, DIM_PAD], tl.float32)
    t_in = tl.arange(0, TILE)
    for t0 in range(start - start % TILE, end, TILE):  # tiles aligned to TILE tokens
        t = t0 + t_in
        valid = (t >= start) & (t < end)
        if TREE:  # a tree row sees, from tree_start on, the positions of its bits alone
            bit = tl.minimum(tl.maximum(t - tree_start, 0), 63).to(tl.int64)
            seen = ((tree_bits >> bit) & 1) != 0
            valid = valid & ((t < tree_start) | (seen & (t - tree_start < 64)))
        page = tl.load(tables_ptr + b * st_b + t // BLOCK_SIZE, mask=valid,
                       other=0).to(tl.int64)
        slot = t % BLOCK_SIZE
        kv_mask = valid[:, None] & (d[None, :] < HEAD_DIM)
        k_row = k_ptr + page * sk_n + slot * sk_t + kvh * sk_h
        v_row = v_ptr + page * sv_n + slot * sv_t + kvh * sv_h
        k = tl.load(k_row[:, None] + d[None, :], mask=kv_mask, other=0.0).to(dot_type)
        v = tl.load(v_row[:, None] + d[None, :], mask=kv_mask, other=0.0).to(dot_type)
        if FP32_DOT:  # no TF32 rounding
            scores = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            scores = tl.dot(q, tl.trans(k))
        if CODED:  # each row's scale: the float16 count of 1 / SCALE_STEPS after its codes
            f16 = tl.pointer_type(tl.float16)
            k_scale = tl.load((k_row + HEAD_DIM).to(f16, bitcast=True), mask=valid,
                              other=0.0).to(tl.float32) / SCALE_STEPS
            v_scale = tl.load((v_row + HEAD_DIM).to(f16, bitcast=True), mask=valid,
                              other=0.0).to(tl.float32) / SCALE_STEPS
            scores = scores * k_scale[None, :]
        scores = tl.where(valid[None, :], scores * scale, float("-inf"))  # [GROUP_PAD, TILE]
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a split with no token yet
        p = tl.exp(scores - m_safe[:, None])
        alpha = tl.exp(m - m_safe)
        s = s * alpha + tl.sum(p, axis=1)
        if CODED:
            p = p * v_scale[None, :]
        if FP32_DOT:
            pv = tl.dot(p, v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(dot_type), v)
        acc = acc * alpha[:, None] + pv
        m = m_new
    lse = tl.where(s > 0, m + tl.log(tl.maximum(s, 1e-30)), float("-inf"))  # padded rows: 0
    out = acc / tl.where(s > 0, s, 1.0)[:, None]
    tl.store(out_ptr + b * so_b + heads[:, None] * so_h + split * so_s + d[None, :], out,
             mask=q_mask)  # one split: straight into the result, in its dtype
    tl.store(lse_ptr + b * sl_b + heads * sl_h + split, lse, mask=g < GROUP)


@triton.jit
def _merge_kernel(part_ptr, lse_ptr, lens_ptr, out_ptr, window, split_tokens,
                  sp_b, sp_h, sp_s, sl_b, sl_h, so_b, so_h,
                  HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr, CHUNK: tl.constexpr):
    """Only the splits that hold a token, read from the first in chunks of CHUNK: the same
    sums in the same order however many empty splits the grid had."""
    b, h = tl.program_id(0), tl.program_id(1)
    n = tl.load(lens_ptr + b)
    lo = tl.maximum(n - window, 0) // split_tokens
    hi = tl.cdiv(n, split_tokens)
    i = tl.arange(0, CHUNK)
    d = tl.arange(0, DIM_PAD)
    m = tl.full([1], float("-inf"), tl.float32)
    s = tl.zeros([1], tl.float32)
    acc = tl.zeros([DIM_PAD], tl.float32)
    for c0 in range(lo, hi, CHUNK):
        idx = c0 + i
        lse = tl.load(lse_ptr + b * sl_b + h * sl_h + idx, mask=idx < hi,
                      other=float("-inf"))
        m_new = tl.maximum(m, tl.max(lse, axis=0))  # finite: every split read holds a token
        w = tl.where(lse > float("-inf"), tl.exp(lse - m_new), 0.0)
        part = tl.load(part_ptr + b * sp_b + h * sp_h + idx[:, None] * sp_s + d[None, :],
                       mask=(w[:, None] > 0) & (d[None, :] < HEAD_DIM), other=0.0)
        alpha = tl.exp(m - m_new)
        acc = acc * alpha + tl.sum(part * w[:, None], axis=0)
        s = s * alpha + tl.sum(w, axis=0)
        m = m_new
    out = acc / tl.maximum(s, 1e-30)
    tl.store(out_ptr + b * so_b + h * so_h + d, out, mask=d < HEAD_DIM)


def num_splits(max_len: int, block_size: int, programs: int = 1) -> tuple[int, int]:
    """(splits, tokens a split covers) for contexts up to `max_len` when `programs`
    (sequences x KV heads) run: MIN_SPLIT_TOKENS per split while few run, doubling as they
    fill the GPU. The length is a whole number of blocks and depends on `programs` alone."""
    per = max(MIN_SPLIT_TOKENS, block_size) * \
        triton.next_power_of_2(triton.cdiv(max(programs, 1), PROGRAMS_PER_MIN_SPLIT))
    per = triton.cdiv(per, block_size) * block_size
    return triton.cdiv(max_len, per), per


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           tables: torch.Tensor, lens: torch.Tensor, scale: float,
                           window: int = 0, tree: torch.Tensor | None = None,
                           max_len: int | None = None) -> torch.Tensor:
    """Attention of each sequence's one query token over its paged context, [B, H, D] in
    q's dtype. `max_len` (the longest context) bounds the grid; by default the block
    table's width does, which needs no device-to-host copy of `lens`."""
    q, tables, lens = q.contiguous(), tables.contiguous(), lens.contiguous()  # unit strides
    batch, heads, dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads are not a multiple of the cache's "
                         f"{kv_heads} KV heads")
    if max_len is None:
        max_len = tables.shape[1] * block_size
    splits, per = num_splits(max(max_len, 1), block_size, batch * kv_heads)
    window = window if window > 0 else 2**30
    result = torch.empty_like(q)
    if splits == 1:
        part, part_strides = result, (*result.stride()[:2], 0)
    else:
        part = torch.empty(batch, heads, splits, dim, dtype=torch.float32, device=q.device)
        part_strides = part.stride()[:3]
    lse = torch.empty(batch, heads, splits, dtype=torch.float32, device=q.device)
    group = heads // kv_heads
    dim_pad = triton.next_power_of_2(dim)
    _split_kernel[(batch, kv_heads, splits)](
        q, k_cache, v_cache, tables, lens, lens if tree is None else tree.contiguous(), part,
        lse, scale, window, per,
        q.stride(0), q.stride(1), *k_cache.stride()[:3], *v_cache.stride()[:3],
        tables.stride(0), *part_strides, lse.stride(0), lse.stride(1),
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), HEAD_DIM=dim,
        DIM_PAD=dim_pad, BLOCK_SIZE=block_size,
        TILE=max(16, min(64, 8192 // dim_pad)),  # K and V tiles of at most 16 KB in bf16
        # float32 models, and Triton's interpreter (CPU tensors), whose dot misreads bfloat16
        FP32_DOT=q.dtype == torch.float32 or q.device.type == "cpu",
        TREE=tree is not None, CODED=k_cache.dtype in CODED_DTYPES)
    if splits > 1:
        _merge_kernel[(batch, heads)](
            part, lse, lens, result, window, per, *part.stride()[:3], lse.stride(0),
            lse.stride(1), result.stride(0), result.stride(1), HEAD_DIM=dim, DIM_PAD=dim_pad,
            CHUNK=MERGE_CHUNK)
    return result
