"""What pausing and weight updates cost on the served path (`tidal serve`, one model):

- `/update_weights_from_disk` of the served model's own file (a whole engine-core start on
  it, the frontend and its connections kept) against restarting `tidal serve` to a healthy
  /health, the way to new weights without it: the ratio restart / update;
- `/pause?mode=keep` and `/pause?mode=abort` answered while `--streams` greedy streams run
  (what a trainer waits before it may swap weights);
- `/sleep` and `/wake_up`: how long each takes and the memory the sleep returns (the engine
  core's resident set, which the machine's available memory regains).

Each run warms the server with a request first; every prompt is fresh.

    python benchmarks/weight_updates.py [--model smollm2-135m] [--runs 3] [--streams 8]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time

import httpx
import psutil

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from server_fixtures import Server  # noqa: E402


def complete(url: str, prompt: str, n: int = 16, **body) -> dict:
    return httpx.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": n,
                                                     "temperature": 0, **body},
                      timeout=600).json()


def timed(call) -> float:
    t = time.perf_counter()
    call()
    return time.perf_counter() - t


def pause_under_load(url: str, mode: str, streams: int, run: int) -> float:
    """Seconds /pause?mode answers with `streams` long completions running; then resumed."""
    answers: list[dict] = []

    def one(j: int) -> None:
        answers.append(complete(url, f"Run {run}.{j} ({mode}): tell me about ships", 400,
                                ignore_eos=True))

    threads = [threading.Thread(target=one, args=(j,)) for j in range(streams)]
    for t in threads:
        t.start()
    time.sleep(3)  # every stream admitted and decoding
    seconds = timed(lambda: httpx.post(url + "/pause", params={"mode": mode,
                                                               "clear_cache": "false"}))
    if mode == "keep":
        time.sleep(0.5)
    httpx.post(url + "/resume")
    for t in threads:
        t.join()
    want = "abort" if mode == "abort" else "length"
    assert all(a["choices"][0]["finish_reason"] == want for a in answers), answers
    return seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--streams", type=int, default=8)
    args = ap.parse_args()
    flags = ("--model", args.model)
    restarts = []
    for _ in range(args.runs):
        t = time.perf_counter()
        Server(*flags, ready_s=600).stop()
        restarts.append(time.perf_counter() - t)
    server = Server(*flags, ready_s=600)
    try:
        url = server.url
        complete(url, "Warm the server up, please.")
        updates, keeps, aborts, sleeps, wakes, freed = [], [], [], [], [], []
        for i in range(args.runs):
            updates.append(timed(lambda: httpx.post(
                url + "/update_weights_from_disk", json={"model_path": args.model},
                timeout=600).raise_for_status()))
            complete(url, f"A fresh prompt, number {i}, after the update.")
            keeps.append(pause_under_load(url, "keep", args.streams, i))
            aborts.append(pause_under_load(url, "abort", args.streams, i))
            core = psutil.Process(server.core_pid()).memory_info().rss
            before = psutil.virtual_memory().available
            sleeps.append(timed(lambda: httpx.post(url + "/sleep", timeout=600)))
            time.sleep(0.5)
            freed.append((core, psutil.virtual_memory().available - before))
            wakes.append(timed(lambda: httpx.post(url + "/wake_up", timeout=600)))
            complete(url, f"Another fresh prompt, number {i}, after the wake.")
    finally:
        server.stop()
    update, restart = statistics.median(updates), statistics.median(restarts)
    print(f"model {args.model}, {args.runs} runs, medians:")
    print(f"  restart tidal serve to healthy: {restart:.2f} s  {[round(x, 2) for x in restarts]}")
    print(f"  /update_weights_from_disk:      {update:.2f} s  {[round(x, 2) for x in updates]}")
    print(f"  restart / update: {restart / update:.2f}x")
    for name, xs in (("keep", keeps), ("abort", aborts)):
        print(f"  /pause?mode={name} with {args.streams} streams: "
              f"{1000 * statistics.median(xs):.1f} ms  {[round(1000 * x, 1) for x in xs]}")
    print(f"  /sleep: {statistics.median(sleeps):.2f} s, /wake_up: "
          f"{statistics.median(wakes):.2f} s  {[round(x, 2) for x in wakes]}")
    for core, gained in freed:
        print(f"  asleep: the core's RSS was {core / 2**20:.0f} MiB; available memory "
              f"+{gained / 2**20:.0f} MiB")


if __name__ == "__main__":
    main()
