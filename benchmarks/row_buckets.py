"""What bounding oneDNN's row counts buys and costs: RSS after multiplying every row count
from 1 to --rows through the embedded model's four decoder projections (bf16, packed as
tidal packs them), once through `PackedLinear` (row counts bounded: `row_bucket`, chunks of
`ROW_CHUNK`) and once straight into oneDNN (each count its own primitive); then the time of
large steps in chunks against one call.

usage: .venv/bin/python benchmarks/row_buckets.py [--rows 600] [--threads 2]
Each mode runs in a fresh process (the caches are per process).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # qkv, o, gate_up, down


def child(mode: str, rows: int, threads: int) -> None:
    import psutil
    import torch

    from tidal.model.linear import PackedLinear

    torch.set_num_threads(threads)
    layers = [PackedLinear(torch.randn(o, i).bfloat16(), None, 16) for o, i in SHAPES]
    def raw(layer, x):  # PackedLinear.forward without the bounded row counts
        if layer.weight32 is not None and x.shape[0] >= layer.fp32_rows:
            x, w = x.float(), layer.weight32
        else:
            w = layer.weight
        return torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")

    run = (lambda layer, x: layer(x)) if mode == "bounded" else raw
    process = psutil.Process()
    base = process.memory_info().rss
    for n in range(1, rows + 1):
        for layer, (_, k) in zip(layers, SHAPES):
            run(layer, torch.randn(n, k).bfloat16())
    print(f"{mode}: row counts 1..{rows}: RSS +{(process.memory_info().rss - base) / 2**20:.0f} MiB")
    if mode == "bounded":
        for n in (1024, 2048, 4096):
            xs = [torch.randn(n, k).bfloat16() for _, k in SHAPES]
            timings = {}
            for label, fn in (("chunks of 256", run), ("one call", raw)):
                best = float("inf")
                for _ in range(5):
                    t0 = time.perf_counter()
                    for layer, x in zip(layers, xs):
                        fn(layer, x)
                    best = min(best, time.perf_counter() - t0)
                timings[label] = best * 1e3
            print(f"  {n} rows: " + ", ".join(f"{k} {v:.1f} ms" for k, v in timings.items()))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=600)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--mode", choices=["bounded", "unbounded"], help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.mode:
        return child(args.mode, args.rows, args.threads)
    for mode in ("unbounded", "bounded"):
        subprocess.run([sys.executable, __file__, "--mode", mode, "--rows", str(args.rows),
                        "--threads", str(args.threads)], check=True)


if __name__ == "__main__":
    main()
