"""A bounded soak against a real `tidal serve` on loopback.

    python benchmarks/soak.py [--requests 5000] [--concurrency 48] [--seed 0] [-- SERVE FLAGS]

Sends a seeded mix of chat and completion requests (prompts of 1-300 words, n up to 4,
logprobs, stop strings, penalties, seeds, temperature 0 or ~1), at most `--concurrency` at
once: 70% stream to the end, 20% stream and disconnect at a random chunk, 10% are
non-streaming clients that give up after a random timeout. Every request that runs to its end
must be well formed (n choices, a finish reason each, usage within n x max_tokens, logprobs
as asked, no stop string in the text). Afterwards the server must hold nothing: KV blocks used,
running and waiting all 0. The frontend's and the engine core's RSS at the end must be within
`--rss-tolerance` of their highest value during the warm-up (the first `--warmup` share of
requests, 30%; a step's transient buffers come and go, a leak outgrows them). Prints the figures; exits 1 if a check fails.

With `--hostile` it runs the mix twice on fresh servers, the second time beside hostile
clients (`hostile.py`: slowloris connections, amplifying and huge-constraint requests, all of
which the server must refuse or close), and checks that the normal clients' p99 latency
stays within `--p99-tolerance` (2x) of the run without them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field

import httpx
import psutil

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

from server_fixtures import Server, metric  # noqa: E402

from hostile import Hostility, hostile_clients  # noqa: E402

WORDS = ("the sea river mountain city paper clip music light quiet green tall old road "
         "window story garden winter bright number table letter house cloud stone").split()
STOPS = [".", "\n", " the", ",", "!"]


@dataclass
class Plan:
    """One request of the mix and what its client does."""

    endpoint: str
    body: dict
    mode: str  # "full" | "disconnect" | "timeout"
    cut_after: int = 0  # chunks read before a disconnecting client leaves
    timeout: float = 0.0  # a non-streaming client's patience


def make_plan(rng: random.Random) -> Plan:
    chat = rng.random() < 0.5
    words = " ".join(rng.choice(WORDS) for _ in range(min(300, int(3 * rng.paretovariate(1.0)))))
    n = rng.choice([1, 1, 1, 2, 3, 4])
    body: dict = {"max_tokens": rng.randint(1, 48), "n": n,
                  "temperature": rng.choice([0.0, 0.7, 1.0])}
    if chat:
        body["messages"] = [{"role": "user", "content": words}]
    else:
        body["prompt"] = words
    if rng.random() < 0.3:
        k = rng.randint(0, 5)
        body.update({"logprobs": True, "top_logprobs": k} if chat else {"logprobs": k})
    if rng.random() < 0.25:
        body["stop"] = rng.sample(STOPS, rng.randint(1, 3))
    if rng.random() < 0.25:
        body.update(frequency_penalty=rng.uniform(-1, 1), presence_penalty=rng.uniform(-1, 1),
                    repetition_penalty=rng.choice([1.0, 1.1, 1.3]))
    if rng.random() < 0.3:
        body["seed"] = rng.randint(0, 2**31)
    x = rng.random()
    mode = "full" if x < 0.7 else "disconnect" if x < 0.9 else "timeout"
    body["stream"] = mode != "timeout" and (mode == "disconnect" or rng.random() < 0.7)
    if body["stream"] and rng.random() < 0.5:
        body["stream_options"] = {"include_usage": True}
    return Plan("/v1/chat/completions" if chat else "/v1/completions", body, mode,
                cut_after=rng.randint(0, 12), timeout=rng.uniform(0.05, 2.0))


@dataclass
class Report:
    outcomes: Counter = field(default_factory=Counter)
    problems: list[str] = field(default_factory=list)
    tokens: int = 0
    latencies: list[float] = field(default_factory=list)  # of the requests run to their end

    def p99(self) -> float:
        ordered = sorted(self.latencies)
        return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] if ordered else 0.0

    def fail(self, plan: Plan, what: str) -> None:
        self.outcomes["malformed"] += 1
        if len(self.problems) < 20:
            self.problems.append(f"{plan.endpoint} {json.dumps(plan.body)[:300]}: {what}")


def check_choice(plan: Plan, text: str, finish: str | None, num_logprobs: int | None,
                 lp_tokens: int | None) -> str | None:
    """What is wrong with one finished choice, or None."""
    if finish not in ("stop", "length"):
        return f"finish_reason {finish!r}"
    if any(s in text for s in plan.body.get("stop", [])):
        return f"a stop string in {text!r}"
    if num_logprobs is not None and lp_tokens is None:
        return "no logprobs"
    if lp_tokens is not None and lp_tokens > plan.body["max_tokens"]:
        return f"{lp_tokens} logprob entries for max_tokens {plan.body['max_tokens']}"
    return None


def logprob_entries(plan: Plan, lp: dict | None) -> int | None:
    if lp is None:
        return None
    if "content" in lp:  # chat
        want = plan.body.get("top_logprobs", 0)
        if any(len(e["top_logprobs"]) != want for e in lp["content"] or []):
            return 10**9  # a wrong top_logprobs count shows as too many entries
        return len(lp["content"] or [])
    return len(lp["tokens"])


async def run_full(http: httpx.AsyncClient, url: str, plan: Plan, report: Report) -> None:
    body, n = plan.body, plan.body["n"]
    want_lp = body.get("top_logprobs", body.get("logprobs")) if body.get("logprobs") not in (
        None, False) else None
    if not body["stream"]:
        resp = await http.post(url + plan.endpoint, json=body)
        if resp.status_code != 200:
            return report.fail(plan, f"HTTP {resp.status_code}: {resp.text[:200]}")
        data = resp.json()
        if sorted(c["index"] for c in data["choices"]) != list(range(n)):
            return report.fail(plan, "choice indices")
        for c in data["choices"]:
            text = c["message"]["content"] if "message" in c else c["text"]
            bad = check_choice(plan, text or "", c["finish_reason"], want_lp,
                               logprob_entries(plan, c.get("logprobs")))
            if bad:
                return report.fail(plan, bad)
        usage = data["usage"]["completion_tokens"]
    else:
        texts, finish, lps = defaultdict(str), {}, Counter()
        usage, done = None, False
        async with http.stream("POST", url + plan.endpoint, json=body) as resp:
            if resp.status_code != 200:
                return report.fail(plan, f"HTTP {resp.status_code}")
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                if line[5:].strip() == "[DONE]":
                    done = True
                    break
                chunk = json.loads(line[5:])
                if "error" in chunk:
                    return report.fail(plan, f"error event {chunk['error']}")
                if chunk.get("usage"):
                    usage = chunk["usage"]["completion_tokens"]
                for c in chunk["choices"]:
                    i = c["index"]
                    delta = c["delta"].get("content") if "delta" in c else c["text"]
                    texts[i] += delta or ""
                    lps[i] += logprob_entries(plan, c.get("logprobs")) or 0
                    if c.get("finish_reason"):
                        if i in finish:
                            return report.fail(plan, f"choice {i} finished twice")
                        finish[i] = c["finish_reason"]
        if not done or sorted(finish) != list(range(n)):
            return report.fail(plan, f"stream ended early (done={done}, finished {finish})")
        for i in range(n):
            bad = check_choice(plan, texts[i], finish[i], want_lp,
                               lps[i] if want_lp is not None else None)
            if bad:
                return report.fail(plan, bad)
        if body.get("stream_options") and usage is None:
            return report.fail(plan, "no usage chunk")
    if usage is not None:
        if usage > n * body["max_tokens"]:
            return report.fail(plan, f"usage {usage} > n x max_tokens")
        report.tokens += usage
    report.outcomes["complete"] += 1


async def run_one(http: httpx.AsyncClient, url: str, plan: Plan, report: Report) -> None:
    if plan.mode == "full":
        t0 = time.perf_counter()
        await run_full(http, url, plan, report)
        report.latencies.append(time.perf_counter() - t0)
        return
    if plan.mode == "disconnect":
        async with http.stream("POST", url + plan.endpoint, json=plan.body) as resp:
            chunks = 0
            async for _ in resp.aiter_lines():
                chunks += 1
                if chunks > plan.cut_after:
                    break  # leaving the block closes the connection mid-stream
        report.outcomes["disconnected"] += 1
        return
    try:
        resp = await http.post(url + plan.endpoint, json=plan.body, timeout=plan.timeout)
        if resp.status_code != 200:
            return report.fail(plan, f"HTTP {resp.status_code}: {resp.text[:200]}")
        report.outcomes["complete_before_timeout"] += 1
    except httpx.TimeoutException:
        report.outcomes["timed_out"] += 1


def rss_mb(pids: list[int]) -> list[float]:
    return [psutil.Process(p).memory_info().rss / 2**20 for p in pids]


async def soak(url: str, pids: list[int], requests: int, concurrency: int, seed: int,
               progress: bool = True, warmup: float = 0.1, hostility: Hostility | None = None
               ) -> tuple[Report, list[float], float]:
    """Run the mix (beside `hostility`'s clients, if given, until it ends); returns the
    report, the highest RSS during the warm-up (the first `warmup` share of the requests)
    and the seconds taken."""
    rng = random.Random(seed)
    plans = [make_plan(rng) for _ in range(requests)]
    report, gate = Report(), asyncio.Semaphore(concurrency)
    warm, warm_rss = max(1, int(requests * warmup)), []
    finished = 0
    limits = httpx.Limits(max_connections=concurrency + 8)
    t0 = time.perf_counter()
    async with httpx.AsyncClient(timeout=600, limits=limits) as http:
        async def one(plan: Plan) -> None:
            nonlocal finished
            async with gate:
                try:
                    await run_one(http, url, plan, report)
                except Exception as exc:  # any surprise is a finding, not a crash of the soak
                    report.fail(plan, f"{type(exc).__name__}: {exc}")
            finished += 1
            if finished <= warm:  # the high-water mark of the warm-up: steps' transient
                now = rss_mb(pids)  # buffers come and go, a leak outgrows them
                warm_rss[:] = [max(a, b) for a, b in zip(warm_rss, now)] if warm_rss else now
            if progress and finished % max(1, requests // 20) == 0:
                rss = ", ".join(f"{r:.0f}" for r in rss_mb(pids))
                print(f"  {finished}/{requests} {dict(report.outcomes)} RSS MiB {rss}",
                      flush=True)

        normal = asyncio.gather(*(one(p) for p in plans))
        if hostility is None:
            await normal
        else:
            hostile = asyncio.ensure_future(hostile_clients(url, hostility))
            await normal
            hostility.stop.set()
            await hostile
    return report, warm_rss, time.perf_counter() - t0


def drained(url: str, timeout: float = 60.0) -> dict[str, float]:
    """The server's queues and used blocks once they reach 0 (or what they are at timeout)."""
    names = ("tidal:kv_cache_used_blocks", "tidal:num_requests_running",
             "tidal:num_requests_waiting", "tidal:num_requests_preempted")
    deadline = time.monotonic() + timeout
    while True:
        figures = {n: metric(url, n) for n in names}
        if not any(figures.values()) or time.monotonic() > deadline:
            return figures
        time.sleep(0.5)


@dataclass
class SoakResult:
    """What a soak saw: the requests' outcomes, what the server held after the drain, and
    the RSS (MiB) of the frontend and the engine core after the warm-up and at the end."""

    report: Report
    seconds: float
    left: dict[str, float]
    warm_rss: list[float]
    end_rss: list[float]
    hostility: Hostility | None = None

    @property
    def growth(self) -> list[float]:
        return [e / w - 1 for w, e in zip(self.warm_rss, self.end_rss)]

    def ok(self, rss_tolerance: float) -> bool:
        return (not self.report.outcomes["malformed"] and not any(self.left.values())
                and all(g <= rss_tolerance for g in self.growth)
                and (self.hostility is None or not self.hostility.problems))


def run_soak(requests: int, concurrency: int, seed: int, serve_flags: list[str],
             progress: bool = True, warmup: float = 0.1,
             hostility: Hostility | None = None) -> SoakResult:
    """Start a server, soak it (beside `hostility`'s clients), wait for it to drain, stop
    it."""
    server = Server(*serve_flags)
    try:
        pids = [server.proc.pid, server.core_pid()]
        report, warm_rss, seconds = asyncio.run(
            soak(server.url, pids, requests, concurrency, seed, progress, warmup, hostility))
        left = drained(server.url)
        end_rss = rss_mb(pids)
    finally:
        server.stop()
    return SoakResult(report, seconds, left, warm_rss, end_rss, hostility)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=5000)
    p.add_argument("--concurrency", type=int, default=48)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rss-tolerance", type=float, default=0.10)
    p.add_argument("--warmup", type=float, default=0.3,
                   help="share of the requests after which the RSS baseline is taken")
    p.add_argument("--hostile", action="store_true",
                   help="run the mix again beside hostile clients and compare the p99")
    p.add_argument("--p99-tolerance", type=float, default=2.0,
                   help="most the normal clients' p99 latency may grow beside hostile ones")
    p.add_argument("serve_flags", nargs="*", help="extra `tidal serve` flags (after --)")
    args = p.parse_args(argv)
    runs = [("alone", None)] + ([("beside hostile clients", Hostility())] if args.hostile
                                else [])
    ok, p99 = True, []
    for name, hostility in runs:
        r = run_soak(args.requests, args.concurrency, args.seed, args.serve_flags,
                     warmup=args.warmup, hostility=hostility)
        print(f"{name}:")
        ok &= summary(args, r)
        p99.append(r.report.p99())
    if args.hostile:
        ratio = p99[1] / p99[0]
        print(f"normal clients' p99 latency: {p99[0]:.2f} s alone, {p99[1]:.2f} s beside "
              f"hostile clients ({ratio:.2f}x; at most {args.p99_tolerance:g}x)")
        ok &= ratio <= args.p99_tolerance
    print("soak " + ("passed" if ok else "FAILED"))
    return 0 if ok else 1


def summary(args: argparse.Namespace, r: SoakResult) -> bool:
    """Print one run's figures; whether its checks passed."""
    report = r.report
    print(f"  {args.requests} requests in {r.seconds:.0f} s ({args.requests / r.seconds:.1f} "
          f"req/s, {report.tokens} tokens in complete requests), concurrency "
          f"{args.concurrency}, p99 latency of complete requests {report.p99():.2f} s")
    print("  outcomes: " + ", ".join(f"{k} {v}" for k, v in sorted(report.outcomes.items())))
    if r.hostility is not None:
        print("  hostile: " + ", ".join(f"{k} {v}" for k, v in
                                        sorted(r.hostility.outcomes.items())))
        for line in r.hostility.problems:
            print("  HOSTILE " + line)
    print("  left after drain: " + ", ".join(f"{k.split(':')[1]} {v:g}"
                                             for k, v in r.left.items()))
    for name, w, e, g in zip(("frontend", "engine core"), r.warm_rss, r.end_rss, r.growth):
        print(f"  RSS {name}: {w:.0f} MiB after warm-up, {e:.0f} MiB at the end ({g:+.1%})")
    for line in report.problems:
        print("  MALFORMED " + line)
    return r.ok(args.rss_tolerance)


if __name__ == "__main__":
    raise SystemExit(main())
