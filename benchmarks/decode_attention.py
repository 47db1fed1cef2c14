"""Decode attention on CPU: tidal's C++ paged decode kernel over every layer of the embedded
model's shape (30 layers, 9 query heads, 3 KV heads of 64), a step's worth of calls over
caches far larger than the last-level cache, as a decode step meets them. Decoding reads
each sequence's whole K and V once a step and computes little on them, so the kernel is
measured against the machine's own streaming read speed (a sum over 256 MiB with the same
threads, measured in the same run): milliseconds a step (the best of `--repeats`, after
one warm-up), GB/s of K and V read, and that as a share of the streaming speed.

    python benchmarks/decode_attention.py [--formats bfloat16 int8 float32]
        [--repeats 5] [--threads N] [--contiguous]

The shapes: 1 sequence of 4,000 tokens, 8 of 1,000 (conversations' next turns), 32 of
500 and 64 of 300 (a busy server). Each sequence's blocks are scattered through the pool,
as a pool's are after some traffic (`--contiguous`: in order).
"""

from __future__ import annotations

import argparse

import torch
from prefill_attention import (BLOCK, HEAD_DIM, HEADS, KV_HEADS,  # the same shape
                               best_ms, extension)

SHAPES = [(1, 4000), (8, 1000), (32, 500), (64, 300)]  # (sequences, context tokens)
LAYERS = 30


def stream_gbs(repeats: int) -> float:
    """GB/s of a sum over 256 MiB of bf16: the speed a pure read stream gets here."""
    x = torch.ones(128 * 2**20, dtype=torch.bfloat16)
    return x.numel() * 2 / best_ms(x.sum, repeats) / 1e6


def one_shape(ext, fmt, batch: int, ctx: int, contiguous: bool,
              repeats: int) -> tuple[float, float]:
    """(ms of one step's attention over every layer, GB of K and V it reads)."""
    from tidal.engine.kv_cache import cache_zeros

    gen = torch.Generator().manual_seed(0)
    width = -(-ctx // BLOCK)
    blocks = batch * width
    store = fmt.storage(torch.float32)
    shape = fmt.cache_shape(blocks, BLOCK, KV_HEADS, HEAD_DIM)

    def cache() -> torch.Tensor:  # in the pool's own memory (huge pages where granted)
        x = torch.randn(blocks, BLOCK, KV_HEADS, HEAD_DIM, generator=gen)
        c = cache_zeros(shape, store, "cpu")
        c.copy_(fmt.encode(x).view(store) if fmt.quantized else x.to(store))
        return c

    layers = [(cache(), cache()) for _ in range(LAYERS)]
    order = torch.arange(blocks) if contiguous else torch.randperm(blocks, generator=gen)
    tables = order.view(batch, width).contiguous()
    lens = torch.full((batch,), ctx, dtype=torch.long)
    q = torch.randn(batch, HEADS, HEAD_DIM, generator=gen)

    def step() -> None:
        for k, v in layers:
            ext.paged_decode_attention(q, k, v, tables, lens, HEAD_DIM ** -0.5, 0, None)

    read = sum(k[0].numel() * k.element_size() * 2 for k, _ in layers) * ctx / BLOCK * batch
    return best_ms(step, repeats), read / 1e9


def main() -> None:
    from tidal.model.kv_quant import KVFormat

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--formats", nargs="+", default=["bfloat16", "int8", "float32"])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--contiguous", action="store_true",
                    help="each sequence's blocks in order (default: scattered)")
    args = ap.parse_args()
    ext = extension(args.threads)
    stream = stream_gbs(args.repeats)
    print(f"{torch.get_num_threads()} threads; streaming read {stream:.1f} GB/s\n")
    print("| KV rows | sequences x context | ms a step (30 layers) | GB/s read | "
          "/ streaming |\n|---|---|---|---|---|")
    for name in args.formats:
        fmt = KVFormat(name)
        for batch, ctx in SHAPES:
            ms, gb = one_shape(ext, fmt, batch, ctx, args.contiguous, args.repeats)
            print(f"| {name} | {batch} x {ctx:,} | {ms:.2f} | {gb / ms * 1e3:.1f} | "
                  f"{gb / ms * 1e3 / stream:.2f} |")


if __name__ == "__main__":
    main()
