"""What open dashboards cost the engine: a real `tidal serve` under a steady closed-loop load
(--concurrency clients, each sending its next request when the last ends), measured in
alternating phases with no dashboard and with --dashboards pages reading
/dashboard/stream. Per phase: the core's mean step time (engine_step_seconds / num_steps
from /metrics: schedule, execute, update, send) and output tokens/s (generation_tokens).
First, without a server: the time a core spends building and encoding one view of a large
scheduler (a view is built twice a second while any page is open).

usage: .venv/bin/python benchmarks/dashboard.py [--dashboards 10] [--phases 6]
                                                [--seconds 20] [--concurrency 8]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time

import httpx

sys.path.insert(0, "tests")
from server_fixtures import Server  # noqa: E402  (the tests' server launcher)


def scrape(url: str) -> dict[str, float]:
    names = ("tidal:engine_step_seconds_total", "tidal:num_steps_total",
             "tidal:generation_tokens_total")
    text = httpx.get(url + "/metrics").text
    return {n: float(line.rsplit(" ", 1)[1]) for line in text.splitlines() for n in names
            if line.startswith(n + "{")}


class Clients:
    """Threads that keep `count` requests (or dashboard streams) open until stopped."""

    def __init__(self, count: int, work) -> None:
        self.running = True
        self.threads = [threading.Thread(target=work, args=(self,), daemon=True)
                        for _ in range(count)]
        for t in self.threads:
            t.start()

    def stop(self) -> None:
        self.running = False
        for t in self.threads:
            t.join(timeout=30)


def request_loop(clients: Clients, url: str) -> None:
    with httpx.Client(timeout=300) as c:
        while clients.running:
            c.post(url + "/v1/completions", json={"prompt": "the tide " * 40, "max_tokens": 32,
                                                  "ignore_eos": True})


def dashboard_loop(clients: Clients, url: str) -> None:
    while clients.running:
        with httpx.stream("GET", url + "/dashboard/stream", timeout=60) as r:
            for _ in r.iter_lines():  # read every event, as a page does
                if not clients.running:
                    return


def view_cost(num_blocks: int = 16384, running: int = 256, waiting: int = 256) -> float:
    """ms to build and encode one view of a scheduler with these queues (best of 20)."""
    from tidal.core import (CacheConfig, KVCacheManager, ModelOutput, Request,
                            SamplingParams, Scheduler, SchedulerConfig)
    from tidal.core.snapshot import StepHistory, scheduler_view
    from tidal.engine import messages as m

    sched = Scheduler(SchedulerConfig(max_num_seqs=running, max_input_tokens_per_step=1 << 20,
                                      chunked_prefill_size=1 << 20),
                      KVCacheManager(CacheConfig(num_blocks=num_blocks, block_size=16)))
    for i in range(running + waiting):
        sched.add_request(Request(str(i), list(range(i * 1000, i * 1000 + 512)),
                                  SamplingParams(max_tokens=64)))
    history = StepHistory()
    for _ in range(3):
        out = sched.schedule()
        history.record(out, 0.01, time.time())
        sched.update(out, ModelOutput({s.request_id: [7] for s in out.scheduled if s.samples}))
    best = float("inf")
    for _ in range(20):
        t0 = time.perf_counter()
        view = scheduler_view(sched, history, 0.0)
        m.encoder.encode(view)
        best = min(best, time.perf_counter() - t0)
    return best * 1000


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dashboards", type=int, default=10)
    p.add_argument("--phases", type=int, default=6, help="alternating, none first")
    p.add_argument("--seconds", type=float, default=20.0)
    p.add_argument("--concurrency", type=int, default=8)
    args = p.parse_args()
    ms = view_cost()
    print(f"one view of 16,384 blocks, 256 running and 256 waiting requests: {ms:.2f} ms to "
          f"build and encode; twice a second: {ms * 2 / 10:.2f}% of a core's time")
    server = Server("--num-threads", "2")
    try:
        load = Clients(args.concurrency, lambda c: request_loop(c, server.url))
        time.sleep(5)  # warm up
        rows = {0: [], args.dashboards: []}
        for phase in range(args.phases):
            pages = 0 if phase % 2 == 0 else args.dashboards
            watchers = Clients(pages, lambda c: dashboard_loop(c, server.url)) if pages else None
            time.sleep(2)
            a = scrape(server.url)
            time.sleep(args.seconds)
            b = scrape(server.url)
            if watchers:
                watchers.stop()
            steps = b["tidal:num_steps_total"] - a["tidal:num_steps_total"]
            step_ms = 1000 * (b["tidal:engine_step_seconds_total"]
                              - a["tidal:engine_step_seconds_total"]) / steps
            rate = (b["tidal:generation_tokens_total"]
                    - a["tidal:generation_tokens_total"]) / args.seconds
            rows[pages].append((step_ms, rate))
            print(f"phase {phase}: {pages:2d} dashboards: step {step_ms:.2f} ms, "
                  f"{rate:.1f} output tokens/s", flush=True)
        load.stop()
    finally:
        server.stop()
    # The VM drifts between phases: compare each watched phase with the unwatched phases
    # around it, and report the median of those ratios.
    base, watched = rows[0], rows[args.dashboards]
    ratios = []
    for i, (step_ms, rate) in enumerate(watched):
        around = base[i:i + 2]  # the phases before and after this one
        ratios.append((step_ms / statistics.mean(b[0] for b in around),
                       rate / statistics.mean(b[1] for b in around)))
    print("| dashboards | step time (median of phases) | output tokens/s |")
    print("| ---: | ---: | ---: |")
    print(f"| 0 | {statistics.median(b[0] for b in base):.2f} ms | "
          f"{statistics.median(b[1] for b in base):.1f} |")
    print(f"| {args.dashboards} | {statistics.median(w[0] for w in watched):.2f} ms | "
          f"{statistics.median(w[1] for w in watched):.1f} |")
    print(f"watched / unwatched phases around it, median: step time "
          f"{statistics.median(r[0] for r in ratios):.3f}, output tokens/s "
          f"{statistics.median(r[1] for r in ratios):.3f}")


if __name__ == "__main__":
    main()
