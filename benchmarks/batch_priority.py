"""Live traffic beside a running batch: `tidal serve` (the embedded model, this machine)
answers a live stream (Poisson arrivals of fresh ShareGPT questions, streamed) three ways:
alone; while a Batch API batch runs (`/v1/batches`: the server paces its lines, one in
flight while live requests are); and while the same lines are sent as ordinary requests,
--naive-concurrency at a time (what a client without the Batch API does). Every phase
sends the same questions at the same times, each behind a tag of its phase ("[2] ..."), so
that the phases compare prompts of the same lengths with nothing carried over in the
prefix cache; the batch lines are questions of their own. The server is warmed up first.

usage: .venv/bin/python benchmarks/batch_priority.py [--live 50] [--rate 0.5]
  [--live-tokens 32] [--batch-lines 256] [--batch-tokens 128] [--naive-concurrency 8]
  [--repeats 1] [--server-log FILE] [--skip-naive] [--trace] [--server-flags '...']

--repeats R alternates the first two phases R times (alone, beside a batch, alone, ...),
each with its own tag and batch, and adds a row of each kind's TTFTs pooled over the
repeats: a p99 of 50 requests is their second-worst, which one slow step moves. On a
shared VM whose speed drifts over minutes, shorter phases alternated more often (`--repeats
4 --live 25`) let the drift fall on both kinds alike.

--trace has the server export its request spans (`--otlp-traces-endpoint`, to a collector
in this process; needs the `otel` extra) and splits each kind's TTFTs: from the engine
core's queue to the step that admits the request (the wait for the step in progress),
and from there to the first token (its prompt's steps).

Target (issue 58): live TTFT p99 beside the batch within 1.2x of the live stream alone.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import math
import os
import random
import re
import shlex
import statistics
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

from server_fixtures import Server, metric  # noqa: E402
from tidal.bench.dataset import iter_json_records, sharegpt_path  # noqa: E402


def questions(count: int, chars: int = 600) -> list[str]:
    out = []
    for record in iter_json_records(sharegpt_path().read_text()):
        msgs = record.get("conversations") or []
        if msgs and msgs[0].get("from") == "human" and len(msgs[0]["value"]) > 40:
            out.append(msgs[0]["value"][:chars])
        if len(out) == count:
            return out
    raise SystemExit(f"the dataset holds fewer than {count} questions")


def _client(url: str):
    import openai

    return openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0,
                              timeout=900)


def trace_id(prompt: str) -> str:
    """The trace a live prompt's request is sent in (--trace)."""
    return hashlib.sha256(prompt.encode()).hexdigest()[:32]


class Spans(BaseHTTPRequestHandler):
    """An OTLP/HTTP collector (--trace): each span's first event of each name, by trace."""

    events: dict[str, dict[str, float]] = {}

    def do_POST(self):  # noqa: N802 (http.server's name)
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
            ExportTraceServiceRequest)

        request = ExportTraceServiceRequest()
        request.ParseFromString(self.rfile.read(int(self.headers["content-length"])))
        for resource in request.resource_spans:
            for scope in resource.scope_spans:
                for span in scope.spans:
                    events = Spans.events.setdefault(span.trace_id.hex(), {})
                    for e in span.events:
                        events.setdefault(e.name, e.time_unix_nano / 1e9)
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args):
        pass


async def live(url: str, prompts: list[str], rate: float, tokens: int,
               trace: bool = False) -> list[float]:
    """Each prompt streamed at Poisson arrivals of `rate` a second (each in its own trace
    if `trace`); their TTFTs."""
    rng = random.Random(0)
    async with _client(url) as client:
        async def one(delay: float, prompt: str) -> float:
            await asyncio.sleep(delay)
            t0 = time.perf_counter()
            headers = {"traceparent": f"00-{trace_id(prompt)}-00f067aa0ba902b7-01"} \
                if trace else None
            stream = await client.chat.completions.create(
                model="smollm2-135m", messages=[{"role": "user", "content": prompt}],
                max_tokens=tokens, temperature=0, stream=True, extra_headers=headers)
            first = None
            async for chunk in stream:
                if first is None and chunk.choices and chunk.choices[0].delta.content:
                    first = time.perf_counter() - t0
            return first if first is not None else time.perf_counter() - t0

        at, delays = 0.0, []
        for _ in prompts:
            at += rng.expovariate(rate)
            delays.append(at)
        return await asyncio.gather(*(one(d, p) for d, p in zip(delays, prompts)))


def batch_body(prompt: str, tokens: int) -> dict:
    return {"model": "smollm2-135m", "messages": [{"role": "user", "content": prompt}],
            "max_tokens": tokens, "ignore_eos": True, "temperature": 0}


async def naive(url: str, prompts: list[str], tokens: int, concurrency: int,
                stop: asyncio.Event) -> int:
    """The batch's lines as ordinary requests, `concurrency` at a time, until `stop`."""
    queue, done = list(prompts), 0
    async with _client(url) as client:
        async def worker():
            nonlocal done
            while queue and not stop.is_set():
                body = batch_body(queue.pop(0), tokens)
                extra = {"ignore_eos": body.pop("ignore_eos")}
                await client.chat.completions.create(**body, extra_body=extra)
                done += 1

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return done


async def beside_batch(url: str, lines: list[str], args, prompts: list[str]):
    async with _client(url) as client:
        text = "\n".join(json.dumps({"custom_id": f"l{i}", "method": "POST",
                                     "url": "/v1/chat/completions",
                                     "body": batch_body(p, args.batch_tokens)})
                         for i, p in enumerate(lines))
        upload = await client.files.create(file=("b.jsonl", text.encode()), purpose="batch")
        batch = await client.batches.create(input_file_id=upload.id, completion_window="24h",
                                            endpoint="/v1/chat/completions")
        while (await client.batches.retrieve(batch.id)).request_counts.completed < 1:
            await asyncio.sleep(0.2)  # under way: lines in flight
        ttfts = await live(url, prompts, args.rate, args.live_tokens, args.trace)
        now = await client.batches.retrieve(batch.id)
        if now.status != "in_progress":
            print(f"the batch ended ({now.status}) before the live stream: raise --batch-lines")
        else:
            await client.batches.cancel(batch.id)
        return ttfts, now.request_counts.completed


async def beside_naive(url: str, lines: list[str], args, prompts: list[str]):
    stop = asyncio.Event()
    flood = asyncio.create_task(naive(url, lines, args.batch_tokens,
                                      args.naive_concurrency, stop))
    await asyncio.sleep(2.0)  # under way
    ttfts = await live(url, prompts, args.rate, args.live_tokens, args.trace)
    if flood.done():
        print("the lines ran out before the live stream: raise --batch-lines")
    stop.set()
    return ttfts, await flood


def wait_profiled(server: Server, timeout: float = 120.0) -> None:
    """Until the engine has timed its step-time profile (a fresh machine times it while
    idle, which would delay the first phase's requests)."""
    deadline = time.monotonic() + timeout
    while (re.search(r"; [1-9]\d* more while idle", log := server.output())
           and "saved to" not in log):
        if time.monotonic() > deadline:
            raise SystemExit("the step-time profile was not done in time")
        time.sleep(1.0)


def slowdown(server: Server) -> float:
    """Measured over predicted step time (median of the server's last 512 steps): well
    above 1, the machine ran slower than the profile it timed, and the phase's figures do
    not compare with the others'."""
    ratio = metric(server.url, 'tidal:step_time_prediction_ratio{quantile="0.5"}')
    return 1 / ratio if ratio else math.nan


def summary(name: str, ttfts: list[float], base: list[float] | None, lines: str,
            server: Server) -> str:
    """A table row: TTFT p50, p90, p99 (ms), their ratios to `base`'s, the batch lines
    done and the machine's slowdown."""
    def pct(xs: list[float]) -> list[float]:
        q = statistics.quantiles(xs, n=100)
        return [statistics.median(xs) * 1000, q[89] * 1000, q[98] * 1000]

    ms = pct(ttfts)
    ratios = [m / b for m, b in zip(ms, pct(base))] if base is not None else [1.0] * 3
    return (f"| {name} | " + " | ".join(f"{m:,.0f}" for m in ms) + " | "
            + " | ".join(f"{r:.2f}x" for r in ratios)
            + f" | {lines} | {slowdown(server):.2f} |")


def split(name: str, prompts: list[str]) -> str:
    """A table row (--trace): the p50, p90 and mean ms of the wait from the engine core's
    queue to admission, and from admission to the first token, of `prompts`' requests."""
    cells = []
    for first, last in (("queued", "admitted"), ("admitted", "first_token")):
        ms = [1000 * (e[last] - e[first]) for p in prompts
              if first in (e := Spans.events.get(trace_id(p), {})) and last in e]
        q = statistics.quantiles(ms, n=10)
        cells += [statistics.median(ms), q[8], statistics.mean(ms)]
    return f"| {name} | " + " | ".join(f"{c:,.0f}" for c in cells) + " |"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--live", type=int, default=50, help="live requests per phase")
    ap.add_argument("--rate", type=float, default=0.5, help="live requests a second")
    ap.add_argument("--live-tokens", type=int, default=32)
    ap.add_argument("--batch-lines", type=int, default=256)
    ap.add_argument("--batch-tokens", type=int, default=128)
    ap.add_argument("--naive-concurrency", type=int, default=8)
    ap.add_argument("--server-log", help="write the server's log to this file")
    ap.add_argument("--skip-naive", action="store_true",
                    help="leave out the phase of lines sent as ordinary requests")
    ap.add_argument("--repeats", type=int, default=1,
                    help="times the alone and beside-a-batch phases alternate")
    ap.add_argument("--trace", action="store_true",
                    help="split the TTFTs by the server's request spans")
    ap.add_argument("--server-flags", default="",
                    help="more `tidal serve` flags, e.g. '--cut-background-steps false'")
    args = ap.parse_args()
    need = args.live + (args.repeats + 1) * args.batch_lines + 4
    pool = questions(need)
    take = iter(range(need))
    chunk = lambda n: [pool[next(take)] for _ in range(n)]  # noqa: E731
    asked = chunk(args.live)
    tagged = lambda phase: [f"[{phase}] {q}" for q in asked]  # noqa: E731
    flags = shlex.split(args.server_flags)
    if args.trace:
        collector = HTTPServer(("127.0.0.1", 0), Spans)
        threading.Thread(target=collector.serve_forever, daemon=True).start()
        flags += ["--otlp-traces-endpoint",
                  f"http://127.0.0.1:{collector.server_address[1]}/v1/traces"]
    with tempfile.TemporaryDirectory() as tmp:
        server = Server("--num-threads", str(os.cpu_count() or 1), "--num-kv-blocks", "4096",
                        "--batch-store", f"{tmp}/b.sqlite", *flags)
        try:
            asyncio.run(live(server.url, chunk(4), 100.0, 8))  # warm-up
            wait_profiled(server)
            print(f"\n{args.live} live requests at {args.rate}/s ({args.live_tokens} tokens "
                  f"each); batch lines of {args.batch_tokens} tokens\n")
            print("| live stream | TTFT p50 ms | p90 ms | p99 ms | p50 vs alone | p90 vs alone "
                  "| p99 vs alone | batch lines done meanwhile | steps measured / predicted |")
            print("|---|---|---|---|---|---|---|---|---|")
            alone, paced, paced_done = [], [], 0
            for r in range(1, args.repeats + 1):
                mark = f" ({r} of {args.repeats})" if args.repeats > 1 else ""
                ttfts = asyncio.run(live(server.url, tagged(f"a{r}"), args.rate,
                                         args.live_tokens, args.trace))
                print(summary("alone" + mark, ttfts, alone[:args.live] or None, "-", server),
                      flush=True)
                alone += ttfts
                ttfts, done = asyncio.run(beside_batch(
                    server.url, chunk(args.batch_lines), args, tagged(f"b{r}")))
                print(summary("beside a Batch API batch" + mark, ttfts, alone[-args.live:],
                              str(done), server), flush=True)
                paced, paced_done = paced + ttfts, paced_done + done
            if args.repeats > 1:
                print(summary(f"beside a batch, pooled over {args.repeats}", paced, alone,
                              str(paced_done), server), flush=True)
            kinds = [("alone", [q for r in range(1, args.repeats + 1)
                                for q in tagged(f"a{r}")]),
                     ("beside a Batch API batch", [q for r in range(1, args.repeats + 1)
                                                   for q in tagged(f"b{r}")])]
            if not args.skip_naive:
                flooded, flood_done = asyncio.run(beside_naive(
                    server.url, chunk(args.batch_lines), args, tagged("n")))
                print(summary(f"beside the lines sent {args.naive_concurrency} at a time",
                              flooded, alone, str(flood_done), server))
                kinds.append(("beside the lines sent as requests", tagged("n")))
            if args.trace:
                time.sleep(3.0)  # the server exports its spans once a second
                print("\n| live stream | queued to admitted p50 ms | p90 ms | mean ms "
                      "| admitted to first token p50 ms | p90 ms | mean ms |")
                print("|---|---|---|---|---|---|---|")
                for name, prompts in kinds:
                    print(split(name, prompts))
        finally:
            log = server.stop()
            if args.server_log:
                Path(args.server_log).write_text(log)


if __name__ == "__main__":
    main()
