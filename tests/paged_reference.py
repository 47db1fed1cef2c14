"""References for the paged attention kernels' tests (Triton and C++): random paged caches,
attention over each sequence's context gathered out of its blocks, and the checks both
prefill kernels pass. A prefill kernel is given to them as `run(q, k_cache, v_cache, tables,
new, lens, scale, window)` (new: each sequence's new tokens; lens: its context with them)
returning (output on the CPU, query starts, context lengths)."""

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


def check_chunks_equal_a_whole_prefill(run, window: int, chunks: tuple[int, ...]) -> None:
    """A sequence prefilled in `chunks` (each over the cached prefix before it) gives the
    rows of one whole-sequence prefill, beside another sequence in the same call."""
    gen = torch.Generator().manual_seed(0)
    block_size, hkv, h, dim, total = 16, 2, 8, 64, sum(chunks)
    blocks = -(-total // block_size) + 6
    k_cache = torch.randn(blocks, block_size, hkv, dim, generator=gen)
    v_cache = torch.randn(blocks, block_size, hkv, dim, generator=gen)
    tables = torch.stack([torch.randperm(blocks, generator=gen)[:blocks - 6]
                          for _ in range(2)]).to(torch.int32)
    q = torch.randn(total, h, dim, generator=gen)
    other = torch.randn(20, h, dim, generator=gen)  # the second sequence: 20 new of 50
    whole, _, _ = run(torch.cat([q, other]), k_cache, v_cache, tables, [total, 20],
                      [total, 50], dim ** -0.5, window)
    done = 0
    for chunk in chunks:
        got, _, _ = run(torch.cat([q[done:done + chunk], other]), k_cache, v_cache, tables,
                        [chunk, 20], [done + chunk, 50], dim ** -0.5, window)
        torch.testing.assert_close(got[:chunk], whole[done:done + chunk], atol=2e-5, rtol=2e-5)
        torch.testing.assert_close(got[chunk:], whole[total:], atol=2e-5, rtol=2e-5)
        done += chunk


def check_reads_nothing_past_the_context(run) -> None:
    """NaN in the slots past each context and in the block the tables are padded with leave
    the rows finite; a block size that is no power of two, a head dim neither, GQA 3."""
    gen = torch.Generator().manual_seed(1)
    block_size, hkv, h, dim = 12, 1, 3, 80
    k_cache = torch.randn(7, block_size, hkv, dim, generator=gen)
    v_cache = torch.randn(7, block_size, hkv, dim, generator=gen)
    tables = torch.tensor([[3, 1, 0, 0], [4, 2, 5, 6]], dtype=torch.int32)
    lens, new = [20, 40], [20, 9]
    for cache in (k_cache, v_cache):
        cache[0] = float("nan")  # the padding block
        cache[1, 20 - 12:] = float("nan")  # sequence 0's last block past its 20 tokens
        cache[6, 40 - 36:] = float("nan")
    q = torch.randn(sum(new), h, dim, generator=gen)
    got, starts, lens_t = run(q, k_cache, v_cache, tables, new, lens, 0.1)
    assert got.isfinite().all()
    want = gathered_prefill(q, k_cache, v_cache, tables, starts, lens_t, 0.1)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
