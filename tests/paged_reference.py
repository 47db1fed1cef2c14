"""References for the paged attention kernels' tests (Triton and C++): random paged caches
and attention over each sequence's context gathered out of its blocks."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def random_cache(gen: torch.Generator, lens: list[int], block_size: int, kv_heads: int,
                 head_dim: int, dtype: torch.dtype, kv: str = "auto"):
    """(k_cache, v_cache, tables): random caches with 4 blocks to spare and, per sequence, a
    shuffled table as wide as the longest context (tables may share blocks); with `kv` a
    quantized format, of its rows (tidal.model.kv_quant)."""
    from tidal.model.kv_quant import KVFormat

    width = max(-(-n // block_size) for n in lens)
    num_blocks = width + 4
    fmt = KVFormat(kv)
    k_cache, v_cache = (
        fmt.encode(x).view(fmt.storage(dtype)) if fmt.quantized else x.to(dtype)
        for x in (torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen)
                  for _ in range(2)))
    tables = torch.stack([torch.randperm(num_blocks, generator=gen)[:width]
                          for _ in lens]).to(torch.int32)
    return k_cache, v_cache, tables


def gathered_prefill(q, k_cache, v_cache, tables, starts, lens, scale, window=0):
    """Each sequence's context copied out of its blocks, then float32 attention of its new
    rows (the last ones of the context) under a causal, optionally windowed, mask."""
    out = torch.empty(q.shape, dtype=torch.float32)
    for s, ctx in enumerate(lens.tolist()):
        a, b = starts[s].item(), starts[s + 1].item()
        k = k_cache[tables[s].long()].flatten(0, 1)[:ctx].float().transpose(0, 1)  # [Hkv, ctx, D]
        v = v_cache[tables[s].long()].flatten(0, 1)[:ctx].float().transpose(0, 1)
        pos = torch.arange(ctx - (b - a), ctx)[:, None]
        keys = torch.arange(ctx)[None, :]
        mask = (keys <= pos) & ((keys > pos - window) if window else True)
        o = F.scaled_dot_product_attention(q[a:b].float().transpose(0, 1), k, v,
                                           attn_mask=mask, scale=scale, enable_gqa=True)
        out[a:b] = o.transpose(0, 1)
    return out
