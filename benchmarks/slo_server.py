"""The slo policy on the real server: `tidal serve` (the embedded model, this machine) under
Poisson arrivals at multiples of its capacity, fcfs against slo (defer and reject), goodput
measured by `tidal bench serve --goodput`.

usage: .venv/bin/python benchmarks/slo_server.py [--num-prompts 60] [--loads 0.5 1 2 3]
  [--ttft-ms 3000] [--tpot-ms 400] [--input-len 128] [--output-len 32]

Capacity is measured first: the fcfs server saturated by every prompt at once (req/s).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

from server_fixtures import Server  # noqa: E402
from tidal.cli import run as tidal_run  # noqa: E402

POLICIES = [("fcfs", []), ("slo, defer", ["--policy", "slo"]),
            ("slo, reject", ["--policy", "slo", "--slo-overload", "reject"])]


def bench(url: str, args: argparse.Namespace, rate: float | None) -> dict:
    argv = ["bench", "serve", "--base-url", url, "--dataset", "random", "--num-prompts",
            str(args.num_prompts), "--random-input-len", str(args.input_len),
            "--random-output-len", str(args.output_len), "--ignore-eos", "--seed", "0",
            "--disable-tqdm", "--goodput", f"ttft:{args.ttft_ms:g}", f"tpot:{args.tpot_ms:g}"]
    if rate is not None:
        argv += ["--request-rate", f"{rate:.4g}"]
    with contextlib.redirect_stdout(io.StringIO()):
        return tidal_run(argv)


def serve(flags: list[str], args: argparse.Namespace) -> Server:
    """A server with `flags`; the slo policy's get the targets as its defaults (they are that
    policy's options: another policy refuses them)."""
    targets = (["--ttft-slo-ms", f"{args.ttft_ms:g}", "--tpot-slo-ms", f"{args.tpot_ms:g}"]
               if "slo" in flags else [])
    return Server("--num-threads", str(args.threads), *targets, *flags)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--num-prompts", type=int, default=60)
    p.add_argument("--loads", type=float, nargs="+", default=[0.5, 1.0, 2.0, 3.0])
    p.add_argument("--ttft-ms", type=float, default=3000)
    p.add_argument("--tpot-ms", type=float, default=400)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = p.parse_args()
    server = serve([], args)
    try:
        bench(server.url, args, None)  # warm-up: every step size once
        capacity = bench(server.url, args, None)["request_throughput"]
    finally:
        server.stop()
    print(f"capacity: {capacity:.2f} req/s ({args.input_len} prompt + {args.output_len} "
          f"output tokens, SLO TTFT {args.ttft_ms:g} ms, TPOT {args.tpot_ms:g} ms)")
    print("| load | policy | goodput req/s | req/s | completed | median TTFT ms | "
          "p99 TTFT ms | median TPOT ms | p99 TPOT ms |")
    print("|---|---|---|---|---|---|---|---|---|")
    for label, flags in POLICIES:
        server = serve(flags, args)
        try:
            bench(server.url, args, None)  # warm-up (and, for slo, the learned step times)
            for load in args.loads:
                r = bench(server.url, args, load * capacity)
                print(f"| {load:g}x | {label} | {r['request_goodput']:.2f} "
                      f"| {r['request_throughput']:.2f} | {r['completed']} "
                      f"| {r['median_ttft_ms']:.0f} | {r['p99_ttft_ms']:.0f} "
                      f"| {r['median_tpot_ms']:.0f} | {r['p99_tpot_ms']:.0f} |", flush=True)
        finally:
            server.stop()


if __name__ == "__main__":
    main()
