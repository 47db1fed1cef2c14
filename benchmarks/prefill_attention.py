"""Prompt attention on CPU: tidal's C++ paged prefill kernel (one call for a step's
prefills, reading K/V from the paged cache in place) against the PyTorch path it replaces
(each sequence's context gathered and decoded, a causal mask built, one SDPA each), for one
layer of the embedded model's shape (9 query heads, 3 KV heads of 64), in each KV format.
Prints milliseconds a call (the best of `--repeats`, after one warm-up) and the ratio.

    python benchmarks/prefill_attention.py [--formats float32 bfloat16 int8]
        [--repeats 5] [--threads N]

The shapes: a 512-token chunk after 2,000 cached tokens and a 256-token one after 3,500 (a
long prompt chunked), 8 returning turns of 37 new tokens after 1,500 cached tokens each (a
conversation's next turn), and fresh prompts of 512 and 2,048 tokens (which a step of
fresh prompts alone gives to SDPA's flash attention instead).
"""

from __future__ import annotations

import argparse
import time

import torch

SHAPES = [  # (cached tokens, new tokens) of each sequence of a step
    ([2000], [512]), ([3500], [256]), ([1500] * 8, [37] * 8), ([0], [512]), ([0], [2048])]
HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16


def best_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times) * 1e3


def extension(threads: int | None):
    """tidal's C++ extension, torch running `threads` threads (None: all)."""
    from tidal.model import cpu_decode

    if threads:
        torch.set_num_threads(threads)
    ext = cpu_decode.extension()
    if ext is None:
        raise SystemExit("tidal's C++ extension could not be built here")
    return ext


def one_shape(ext, fmt, cached: list[int], new: list[int], repeats: int) -> tuple[float, float]:
    """(PyTorch path ms, C++ kernel ms) for one step of these prefills."""
    from tidal.model.attention import (AttentionMetadata, PrefillSeq, TorchAttention,
                                       prefix_causal_mask)

    gen = torch.Generator().manual_seed(0)
    lens = [c + n for c, n in zip(cached, new)]
    width = max(-(-n // BLOCK) for n in lens)
    store = fmt.storage(torch.float32)
    caches = []
    for _ in range(2):
        x = torch.randn(width * len(lens), BLOCK, KV_HEADS, HEAD_DIM, generator=gen)
        caches.append(fmt.encode(x).view(store) if fmt.quantized else x.to(store))
    tables = torch.arange(width * len(lens)).view(len(lens), width)
    tokens = sum(new)
    q = torch.randn(tokens, HEADS, HEAD_DIM, generator=gen)
    k, v = (torch.randn(tokens, KV_HEADS, HEAD_DIM, generator=gen) for _ in range(2))
    starts = torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()])
    seqs, start = [], 0
    for c, n, table in zip(cached, new, tables):
        seqs.append(PrefillSeq(start, n, c, table if c else None,
                               prefix_causal_mask(c, n, "cpu") if c else None))
        start += n
    meta = AttentionMetadata(torch.zeros(tokens, dtype=torch.long), seqs, tokens)
    backend = TorchAttention(HEADS, KV_HEADS, HEAD_DIM, kv=fmt)
    out = torch.empty_like(q)
    torch_ms = best_ms(lambda: backend._prefill_each(q, k, v, *caches, meta, 0, out), repeats)
    cpp_ms = best_ms(lambda: ext.paged_prefill_attention(
        q, *caches, tables, starts, torch.tensor(lens), HEAD_DIM ** -0.5, max(new), 0), repeats)
    return torch_ms, cpp_ms


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--formats", nargs="+", default=["float32", "bfloat16", "int8"],
                    help="--kv-cache-dtype values (under a float32 model)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")
    args = ap.parse_args()
    from tidal.model.kv_quant import KVFormat

    ext = extension(args.threads)
    print(f"{torch.get_num_threads()} threads; one layer, {HEADS} query heads, {KV_HEADS} KV "
          f"heads of {HEAD_DIM}\n")
    print("| KV | step's prefills | PyTorch path | C++ kernel | PyTorch / C++ |")
    print("|---|---|---|---|---|")
    for name in args.formats:
        fmt = KVFormat(name)
        for cached, new in SHAPES:
            t, c = one_shape(ext, fmt, cached, new, args.repeats)
            step = (f"{len(new)} x " if len(new) > 1 else "") + (
                f"{new[0]:,} new after {cached[0]:,}" if cached[0] else f"{new[0]:,} fresh")
            print(f"| {name} | {step} | {t:.1f} ms | {c:.1f} ms | {t / c:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
