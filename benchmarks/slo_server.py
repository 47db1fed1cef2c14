"""Scheduling on the real server: `tidal serve` (the embedded model, this machine) under
Poisson arrivals at multiples of its capacity, with requests shaped like a real trace (the
Azure 2023 conversation trace's token counts, scaled by --length-scale), goodput measured by
`tidal bench serve --goodput`. Policies: fcfs with the token budgets alone (`--max-step-ms
0`), fcfs with steps sized by time (the default), slo (defer and reject).

usage: .venv/bin/python benchmarks/slo_server.py [--num-prompts 60] [--loads 1 2]
  [--ttft-ms 2500] [--tpot-ms 300] [--length-scale 0.125] [--policies fcfs-tokens fcfs ...]
  [--simulate [--repeats 3] [--profile-out FILE]]

Capacity is measured first, on other prompts than the measured ones (another seed: no
prefix-cache carry-over): the default fcfs server saturated by every prompt at once (req/s).
Every server is warmed up alike (a run of prompts of a third seed, all at once). With
--simulate, `tidal simulate` runs the same workloads with a profile that times steps by the
capacity server's own learned step-time model and its steps' scatter around it, after it
served one more run at the capacity rate (`tidal calibrate --learned-from`), and its goodput is printed beside the server's; with --repeats,
a last table compares their means (one run of 60 requests at the saturated rate swings by
+-30%; the error is left out where the server's goodput is under 0.5 req/s).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import itertools
import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

from server_fixtures import Server, metric  # noqa: E402
from tidal.cli import run as tidal_run  # noqa: E402

POLICIES = {"fcfs-tokens": ["--max-step-ms", "0"], "fcfs": [],
            "slo-defer": ["--policy", "slo"],
            "slo-reject": ["--policy", "slo", "--slo-overload", "reject"]}
# Each run its own prompts (a seed each), so that no run is served from another's prefix
# cache: the measured loads' seeds, then the capacity run's and the warm-ups'.
MEASURED_SEED, CAPACITY_SEED, WARMUP_SEED, PROFILE_SEED = 10, 1, 2, 3
NUM_KV_BLOCKS = 4096  # the servers' pool, and the simulated one


def workload(args: argparse.Namespace, seed: int) -> list[str]:
    """The dataset flags `tidal bench serve` and `tidal simulate` share."""
    argv = ["--num-prompts", str(args.num_prompts), "--seed", str(seed)]
    if args.dataset == "azure-conv":
        return argv + ["--dataset", "azure-conv", "--length-scale", f"{args.length_scale:g}"]
    return argv + ["--dataset", "random", "--random-input-len", str(args.input_len),
                   "--random-output-len", str(args.output_len)]


def bench(url: str, args: argparse.Namespace, seed: int, rate: float | None) -> dict:
    argv = ["bench", "serve", "--base-url", url, *workload(args, seed), "--ignore-eos",
            "--disable-tqdm",
            "--goodput", f"ttft:{args.ttft_ms:g}", f"tpot:{args.tpot_ms:g}"]
    argv += ["--request-rate", f"{rate:.4g}" if rate is not None else "inf"]
    with contextlib.redirect_stdout(io.StringIO()):
        return tidal_run(argv)


def simulate(profile: str, flags: list[str], args: argparse.Namespace, seed: int,
             rate: float) -> dict:
    argv = ["simulate", "--model-config", "smollm2-135m", "--hardware", profile,
            "--num-kv-blocks", str(NUM_KV_BLOCKS), *workload(args, seed),
            "--request-rate", f"{rate:.4g}",
            "--goodput", f"ttft:{args.ttft_ms:g}", f"tpot:{args.tpot_ms:g}", *flags,
            *targets(flags, args)]
    with contextlib.redirect_stdout(io.StringIO()):
        return tidal_run(argv)


def targets(flags: list[str], args: argparse.Namespace) -> list[str]:
    """The slo policy gets the targets as its defaults (they are that policy's options:
    another policy refuses them)."""
    if "slo" not in flags:
        return []
    return ["--ttft-slo-ms", f"{args.ttft_ms:g}", "--tpot-slo-ms", f"{args.tpot_ms:g}"]


def serve(flags: list[str], args: argparse.Namespace) -> Server:
    return Server("--num-threads", str(args.threads), "--num-kv-blocks", str(NUM_KV_BLOCKS),
                  *targets(flags, args), *flags)


def model_error(url: str) -> str:
    """The server's step-time model's predicted / measured step time over its last 512
    steps (`tidal:step_time_prediction_ratio`), p50 and p99."""
    try:
        p50, p99 = (metric(url, f'tidal:step_time_prediction_ratio{{quantile="{q}"}}')
                    for q in ("0.5", "0.99"))
    except KeyError:  # no step-time model there
        return "-"
    return f"{p50:.2f} {p99:.2f}"


def learned_profile(url: str, path: str | None) -> str:
    """A profile of this machine for `tidal simulate` (written to `path`, or a temporary
    file): the server's own learned step-time model and its steps' scatter around it, after
    it served the capacity run (`tidal calibrate --learned-from`)."""
    path = path or os.path.join(tempfile.mkdtemp(), "this-machine.json")
    with contextlib.redirect_stdout(io.StringIO()):
        tidal_run(["calibrate", "--hardware", "cpu", "--learned-from", url, "--output", path])
    return path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--num-prompts", type=int, default=60)
    p.add_argument("--loads", type=float, nargs="+", default=[1.0, 2.0])
    p.add_argument("--ttft-ms", type=float, default=2500)
    p.add_argument("--tpot-ms", type=float, default=300)
    p.add_argument("--dataset", choices=("azure-conv", "random"), default="azure-conv")
    p.add_argument("--length-scale", type=float, default=0.125)
    p.add_argument("--input-len", type=int, default=128, help="random: prompt tokens")
    p.add_argument("--output-len", type=int, default=32, help="random: output tokens")
    p.add_argument("--policies", nargs="+", choices=list(POLICIES), default=list(POLICIES))
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--simulate", action="store_true",
                   help="also run each load in `tidal simulate` with this machine's profile")
    p.add_argument("--profile-out", help="--simulate: keep the profile in this file")
    p.add_argument("--repeats", type=int, default=1,
                   help="runs per load and policy, each on prompts of its own (with "
                   "--simulate, their mean goodput is compared)")
    args = p.parse_args()
    server = serve([], args)
    try:
        bench(server.url, args, WARMUP_SEED, None)
        capacity = bench(server.url, args, CAPACITY_SEED, None)["request_throughput"]
        profile = None
        if args.simulate:  # the model and its scatter as Poisson arrivals at capacity see it
            bench(server.url, args, PROFILE_SEED, capacity)
            profile = learned_profile(server.url, args.profile_out)
    finally:
        server.stop()
    print(f"capacity: {capacity:.2f} req/s ({args.dataset}, {args.num_prompts} prompts; SLO "
          f"TTFT {args.ttft_ms:g} ms, TPOT {args.tpot_ms:g} ms)")
    sim = " simulated goodput |" if profile else ""
    print(f"| load | policy | goodput req/s |{sim} req/s | completed | median TTFT ms | "
          "p99 TTFT ms | median TPOT ms | p99 TPOT ms | predicted / measured step, p50 p99 |")
    print("|---" * (10 + bool(profile)) + "|")
    goodputs: dict[tuple[float, str], list[tuple[float, float]]] = {}  # (server, simulated)
    for label in args.policies:
        flags = POLICIES[label]
        server = serve(flags, args)
        try:
            bench(server.url, args, WARMUP_SEED, None)
            for turn, (i, load) in itertools.product(range(args.repeats),
                                                     enumerate(args.loads)):
                seed, rate = MEASURED_SEED + 10 * turn + i, load * capacity
                r = bench(server.url, args, seed, rate)
                simulated = ""
                if profile:
                    sim = simulate(profile, flags, args, seed, rate)
                    simulated = f" {sim['request_goodput']:.2f} |"
                    goodputs.setdefault((load, label), []).append(
                        (r["request_goodput"], sim["request_goodput"]))
                print(f"| {load:g}x | {label} | {r['request_goodput']:.2f} |{simulated} "
                      f"{r['request_throughput']:.2f} | {r['completed']} "
                      f"| {r['median_ttft_ms']:.0f} | {r['p99_ttft_ms']:.0f} "
                      f"| {r['median_tpot_ms']:.0f} | {r['p99_tpot_ms']:.0f} "
                      f"| {model_error(server.url)} |", flush=True)
        finally:
            server.stop()
    if goodputs:
        summary(goodputs)


def summary(goodputs: dict[tuple[float, str], list[tuple[float, float]]]) -> None:
    """Mean goodput of the server's runs and of the simulated ones, per load and policy."""
    print("\n| load | policy | runs | server goodput req/s | simulated | error |")
    print("|---" * 6 + "|")
    for (load, label), pairs in sorted(goodputs.items()):
        served, simulated = (statistics.mean(x) for x in zip(*pairs))
        error = f"{simulated / served - 1:+.0%}" if served >= 0.5 else "-"
        print(f"| {load:g}x | {label} | {len(pairs)} | {served:.2f} | {simulated:.2f} "
              f"| {error} |")


if __name__ == "__main__":
    main()
