"""Paged prefill attention in Triton: a step's new query tokens of several sequences against
their whole context (the cached prefix and the new tokens), read in place from the paged KV
cache, causal, flash-attention style. Unlike the decode kernel, which splits one query row's
context across programs and merges them, each program here owns a tile of query rows and walks
its keys once: the rows themselves give the GPU enough programs.

`paged_prefill_attention(q, k_cache, v_cache, block_tables, query_starts, context_lens, scale,
max_query_len, window=0)`: q [T, H, D], sequence s owning rows query_starts[s]:
query_starts[s + 1]; caches [num_blocks, block_size, Hkv, D] already holding the new tokens'
K/V (or their int8 / float8_e4m3fn rows of D codes and a float16 scale, tidal.model.kv_quant:
scores take the keys' scales after the product, weights the values' before); context_lens [S]
the lengths with the new tokens included, so the i-th of a sequence's n new rows sits at
position context_lens[s] - n + i and sees the keys at or before it (the last
`window` of them, itself included, when window > 0). A program's tile is BLOCK_Q consecutive
tokens times the query heads of one KV head's GQA group (TILE_ROWS rows), so the group shares
its K/V loads; it takes BLOCK_N keys a step, each gathered through the block table (any block
size), from the first its window reaches to its last row's position: key tiles wholly past the
causal limit or before the window are never visited.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tidal.model.kv_quant import CODES, SCALE_STEPS as STEPS

TILE_ROWS = 64  # query rows (tokens x heads of a group) a program holds, at least 16 for dot
BLOCK_N = 64  # keys a step of a program's loop takes, gathered from whichever blocks hold them
_DOT_TYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}
CODED_DTYPES = tuple(CODES.values())  # caches of quantized rows
SCALE_STEPS = tl.constexpr(STEPS)  # a row's float16 scale counts 1 / SCALE_STEPS units


@triton.jit
def _prefill_kernel(q_ptr, k_ptr, v_ptr, tables_ptr, starts_ptr, lens_ptr, out_ptr,
                    qk_scale, window,
                    sq_t, sq_h, sk_n, sk_t, sk_h, sv_n, sv_t, sv_h, st_s, so_t, so_h,
                    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_Q: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
                    DIM_PAD: tl.constexpr, DOT_TYPE: tl.constexpr, PRECISION: tl.constexpr,
                    CODED: tl.constexpr):
    tile, seq, kvh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    q_start = tl.load(starts_ptr + seq)
    n_new = tl.load(starts_ptr + seq + 1) - q_start
    ctx = tl.load(lens_ptr + seq)
    first = tile * BLOCK_Q
    # row r of the tile: token first + r // GROUP_PAD, head r % GROUP_PAD of the KV head's group
    rows = tl.arange(0, BLOCK_Q * GROUP_PAD)
    tok = first + rows // GROUP_PAD
    head = kvh * GROUP + rows % GROUP_PAD
    d = tl.arange(0, DIM_PAD)
    d_ok = d < HEAD_DIM
    io_mask = ((tok < n_new) & (rows % GROUP_PAD < GROUP))[:, None] & d_ok[None, :]
    io_off = (q_start + tok).to(tl.int64)[:, None] * sq_t + head[:, None] * sq_h + d[None, :]
    q = tl.load(q_ptr + io_off, mask=io_mask, other=0.0).to(DOT_TYPE)
    pos = (ctx - n_new + tok).to(tl.int64)[:, None]  # int64 spares the interpreter's checks
    pos_lo = pos - window  # keys at or before pos_lo are outside the window
    # the keys any row of the tile sees: from its first row's window to its last row
    lo = tl.maximum(ctx - n_new + first - window + 1, 0)
    hi = tl.where(first < n_new, ctx - n_new + tl.minimum(first + BLOCK_Q, n_new), 0)
    # a finite floor: a row with no key seen yet (window) gets p = 0 and alpha = 1, not NaN
    m = tl.full([BLOCK_Q * GROUP_PAD], -1e30, tl.float32)
    s = tl.zeros([BLOCK_Q * GROUP_PAD], tl.float32)
    acc = tl.zeros([BLOCK_Q * GROUP_PAD, DIM_PAD], tl.float32)
    t_in = tl.arange(0, BLOCK_N).to(tl.int64)
    table = tables_ptr + seq * st_s
    k_base = k_ptr + kvh * sk_h + d[:, None]  # K transposed: [DIM_PAD, BLOCK_N]
    v_base = v_ptr + kvh * sv_h + d[None, :]
    for start in range(lo // BLOCK_N * BLOCK_N, hi, BLOCK_N):
        t = start + t_in
        t_ok = t < hi  # past it: slots that may hold anything (NaN), or no table entry at all
        page = tl.load(table + t // BLOCK_SIZE, mask=t_ok, other=0).to(tl.int64)
        slot = t % BLOCK_SIZE
        # K past hi is finite or not, the mask below drops its scores; V's must be zeros
        k = tl.load(k_base + (page * sk_n + slot * sk_t)[None, :], mask=d_ok[:, None],
                    other=0.0).to(DOT_TYPE)
        v = tl.load(v_base + (page * sv_n + slot * sv_t)[:, None],
                    mask=t_ok[:, None] & d_ok[None, :], other=0.0).to(DOT_TYPE)
        scores = tl.dot(q, k, input_precision=PRECISION) * qk_scale  # log2 units
        if CODED:  # each row's scale: the float16 count of 1 / SCALE_STEPS after its codes
            f16 = tl.pointer_type(tl.float16)
            k_row = k_ptr + kvh * sk_h + page * sk_n + slot * sk_t + HEAD_DIM
            v_row = v_ptr + kvh * sv_h + page * sv_n + slot * sv_t + HEAD_DIM
            k_scale = tl.load(k_row.to(f16, bitcast=True), mask=t_ok, other=0.0)
            scores = scores * (k_scale.to(tl.float32) / SCALE_STEPS)[None, :]
            v_scale = tl.load(v_row.to(f16, bitcast=True), mask=t_ok,
                              other=0.0).to(tl.float32) / SCALE_STEPS
        seen = (t[None, :] <= pos) & (t[None, :] > pos_lo)
        scores = tl.where(seen, scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        p = tl.math.exp2(scores - m_new[:, None])
        alpha = tl.math.exp2(m - m_new)
        s = s * alpha + tl.sum(p, axis=1)
        if CODED:
            p_v = p * v_scale[None, :]
        else:
            p_v = p
        acc = acc * alpha[:, None] + tl.dot(p_v.to(DOT_TYPE), v, input_precision=PRECISION)
        m = m_new
    out = acc / tl.where(s > 0, s, 1.0)[:, None]  # padded rows saw nothing and store nothing
    io_off = (q_start + tok).to(tl.int64)[:, None] * so_t + head[:, None] * so_h + d[None, :]
    tl.store(out_ptr + io_off, out.to(out_ptr.dtype.element_ty), mask=io_mask)


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, query_starts: torch.Tensor,
                            context_lens: torch.Tensor, scale: float, max_query_len: int,
                            window: int = 0) -> torch.Tensor:
    """Causal attention of each sequence's new query rows over its paged context, [T, H, D]
    in q's dtype, accumulated in float32. `max_query_len` (the most new rows of a sequence,
    known on the host) sizes the grid, so nothing is copied back from the device."""
    q, block_tables = q.contiguous(), block_tables.contiguous()
    query_starts, context_lens = query_starts.contiguous(), context_lens.contiguous()
    tokens, heads, dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads are not a multiple of the cache's "
                         f"{kv_heads} KV heads")
    out = torch.empty_like(q)
    seqs = context_lens.shape[0]
    if tokens == 0 or seqs == 0:
        return out
    group = heads // kv_heads
    group_pad = triton.next_power_of_2(group)
    block_q = max(1, TILE_ROWS // group_pad)
    # the dots' operand type: q's, but float32 under Triton's interpreter, whose dot multiplies
    # bfloat16 as the uint16 it stores it in; float32 products are exact (IEEE, no TF32)
    interpreted = not isinstance(_prefill_kernel, triton.JITFunction)  # TRITON_INTERPRET=1
    dot_type = tl.float32 if interpreted else _DOT_TYPES[q.dtype]
    grid = (triton.cdiv(max_query_len, block_q), seqs, kv_heads)
    _prefill_kernel[grid](
        q, k_cache, v_cache, block_tables, query_starts, context_lens, out,
        scale * 1.4426950408889634, window if window > 0 else 2**30,  # exp2(x log2 e) = e^x
        q.stride(0), q.stride(1), *k_cache.stride()[:3], *v_cache.stride()[:3],
        block_tables.stride(0), out.stride(0), out.stride(1),
        GROUP=group, GROUP_PAD=group_pad, BLOCK_Q=block_q, BLOCK_N=BLOCK_N,
        BLOCK_SIZE=block_size, HEAD_DIM=dim, DIM_PAD=max(16, triton.next_power_of_2(dim)),
        DOT_TYPE=dot_type, PRECISION="ieee" if dot_type == tl.float32 else "tf32",
        CODED=k_cache.dtype in CODED_DTYPES)
    return out
