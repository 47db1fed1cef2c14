"""`tidal bench serve`: drive an OpenAI-compatible server with a workload and report TTFT,
TPOT, ITL, E2E latency, throughput and goodput (the JSON keys of `vllm bench serve`)."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import time
from dataclasses import replace

from tidal.bench.arrivals import ramp_rates, rps_change_events
from tidal.bench.client import Target, run_workload, wait_ready
from tidal.bench.dataset import BenchRequest, warmup_requests
from tidal.bench.flags import (add_workload_flags, key_values, load_workload, ramp_up,
                               report_options, result_header, save_result)
from tidal.bench.metrics import (PERCENTILES, RequestResult, format_report, parse_goodput,
                                 summarize)
from tidal.engine.flags import flag_errors

DEFAULT_TOKENIZER = "smollm2-135m"  # whose tokenizer makes the prompts, unless told


def add_bench_serve_parser(sub) -> None:
    p = sub.add_parser("serve", help="benchmark a running OpenAI-compatible server")
    p.add_argument("--base-url", default=None, help="default: http://HOST:PORT")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--endpoint", default="/v1/completions",
                   help="/v1/completions or /v1/chat/completions")
    p.add_argument("--model", default=None, help="model name to send (default: the server's "
                                                 "first in /v1/models)")
    p.add_argument("--tokenizer", default=DEFAULT_TOKENIZER,
                   help="model (embedded name or folder) whose tokenizer makes the prompts")
    p.add_argument("--api-key", default=None)
    p.add_argument("--backend", default="openai", help="label stored in the result")
    p.add_argument("--ignore-eos", action="store_true",
                   help="generate exactly the requested output lengths")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--disable-tqdm", action="store_true")
    p.add_argument("--flush-cache", "--reset-prefix-cache", dest="flush_cache",
                   action="store_true", help="have the server forget its cached prefixes "
                   "before the run (SGLang's flag: /reset_prefix_cache, else /flush_cache)")
    add_request_flags(p)
    add_workload_flags(p)
    p.set_defaults(func=cmd_bench_serve)


def add_request_flags(p: argparse.ArgumentParser) -> None:
    """What each request carries beyond the workload, and what comes before and after the
    timed run (`vllm bench serve`'s flags)."""
    r = p.add_argument_group("requests (vLLM's flags)")
    r.add_argument("--served-model-name", default=None,
                   help="the model name the requests carry (over --model)")
    r.add_argument("--top-p", type=float, default=None, help="sent (default: the server's)")
    r.add_argument("--top-k", type=int, default=None, help="sent (default: the server's)")
    r.add_argument("--min-p", type=float, default=None, help="sent (default: the server's)")
    r.add_argument("--logprobs", type=int, default=None, metavar="N",
                   help="ask each token's N most likely tokens' logprobs")
    r.add_argument("--use-beam-search", action="store_true", help="ask for beam search")
    r.add_argument("--extra-body", "--extra-request-body", dest="extra_body", default=None,
                   metavar="JSON", help="a JSON object merged into every request body last")
    r.add_argument("--header", nargs="+", default=None, metavar="KEY=VALUE",
                   help="HTTP headers every request carries")
    r.add_argument("--request-id-prefix", default=None,
                   help="each request's x-request-id header: this prefix and its index")
    r.add_argument("--num-warmups", type=int, default=0,
                   help="requests sent before the timed run, of the workload's shape with "
                        "prompts of their own (none of the run's is cached by them)")
    r.add_argument("--ready-check-timeout-sec", type=float, default=600.0,
                   help="seconds to wait for the server to answer /v1/models first")
    r.add_argument("--profile", action="store_true",
                   help="the server's torch.profiler traces the run (/start_profile before "
                        "it, /stop_profile after; tidal serve --profiler-dir)")
    why = "accepted, no effect: prompts are made by --tokenizer's fast tokenizer, no code run"
    r.add_argument("--trust-remote-code", action="store_true", default=argparse.SUPPRESS,
                   help=why)
    r.add_argument("--tokenizer-mode", default=argparse.SUPPRESS, help=why)


def request_target(args: argparse.Namespace) -> Target:
    """The server, endpoint and what every request carries, from the flags."""
    extra = {}
    if args.extra_body is not None:
        try:
            extra = json.loads(args.extra_body)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--extra-body is not JSON: {exc}") from None
        if not isinstance(extra, dict):
            raise ValueError("--extra-body must be a JSON object")
    sampling = {k: v for k, v in (("top_p", args.top_p), ("top_k", args.top_k),
                                  ("min_p", args.min_p)) if v is not None}
    if args.use_beam_search:
        sampling["use_beam_search"] = True
    return Target(base_url=args.base_url or f"http://{args.host}:{args.port}",
                  endpoint=args.endpoint, model=args.served_model_name or args.model,
                  api_key=args.api_key, ignore_eos=args.ignore_eos,
                  temperature=args.temperature, sampling=sampling, logprobs=args.logprobs,
                  extra_body=extra, extra_headers=key_values(args.header, "--header"),
                  request_id_prefix=args.request_id_prefix)


def prompt_text(tokenizer, ids: list[int]) -> str:
    """Text that the server tokenizes back into as many tokens as `ids` (the simulator
    replays the ids): synthetic ids decode to text that re-encodes to more tokens (+3.5% on
    random 128-token prompts), so re-encode once and keep the first len(ids), as vLLM's
    random dataset does; measured exact for 200 of 200 such prompts."""
    text = tokenizer.decode(ids)
    return tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)[:len(ids)])


def bench_serve(target: Target, tokenizer, requests: list[BenchRequest], times: list[float],
                max_concurrency: int | None = None, slos: dict[str, float] | None = None,
                progress: bool = False, percentiles: tuple[float, ...] = PERCENTILES
                ) -> tuple[dict, list[RequestResult]]:
    """Send `requests` to `target` at `times` (seconds from the start), at most
    `max_concurrency` at once, with prompts made by `tokenizer`; returns the summary (the
    vLLM keys, goodput under `slos`, the `percentiles` of each metric) and each request's
    result. `target.model` is filled in from the server when unset."""
    prompts = [r.text if r.text is not None else prompt_text(tokenizer, r.prompt_ids)
               for r in requests]
    results, duration = asyncio.run(run_workload(
        target, requests, prompts, times, max_concurrency, progress))
    return summarize(results, duration, slos, percentiles), results


_SPEC = ("drafts", "draft_tokens", "accepted_tokens")


def spec_counters(base_url: str) -> dict[str, float] | None:
    """A tidal server's speculative-decoding counters from /metrics (summed over models);
    None where the server has none (a peer engine, or no speculation)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    try:
        text = httpx.get(base_url.rstrip("/") + "/metrics", timeout=5).text
        families = list(text_string_to_metric_families(text))
    except (httpx.HTTPError, ValueError):
        return None
    found = {f.name: sum(s.value for s in f.samples if s.name.endswith("_total"))
             for f in families}
    names = {k: f"tidal:spec_decode_num_{k}" for k in _SPEC}
    return {k: found[n] for k, n in names.items()} if all(
        n in found for n in names.values()) else None


def post_control(target: Target, paths: tuple[str, ...], flag: str) -> str:
    """POST to the first of `paths` the server takes (200); the path. SystemExit naming
    `flag` and the last answer where it takes none."""
    import httpx

    for path in paths:
        try:
            r = httpx.post(target.base_url.rstrip("/") + path, headers=target.headers(),
                           timeout=300)
        except httpx.HTTPError as exc:
            raise SystemExit(f"bench serve: {flag}: {exc}") from None
        if r.status_code == 200:
            return path
    raise SystemExit(f"bench serve: {flag}: {target.base_url} took none of "
                     f"{', '.join(paths)} (last answer: {r.status_code} "
                     f"{' '.join(r.text.split())[:200]})")


def flush_cache(target: Target) -> str:
    """Ask the server to forget its cached prefixes: vLLM's and tidal's
    /reset_prefix_cache, else SGLang's /flush_cache; the path that answered. SystemExit
    where neither does (llama-server; vLLM outside its dev mode)."""
    return post_control(target, ("/reset_prefix_cache", "/flush_cache"), "--flush-cache")


def spec_summary(before: dict | None, after: dict | None) -> dict | None:
    """The run's verifications, guesses, accepted guesses, acceptance rate and mean
    accepted length (tokens per verification, the model's own included)."""
    if not before or not after or after["drafts"] == before["drafts"]:
        return None
    d = {k: after[k] - before[k] for k in _SPEC}
    d["acceptance_rate"] = d["accepted_tokens"] / max(1.0, d["draft_tokens"])
    d["mean_accepted_length"] = 1 + d["accepted_tokens"] / d["drafts"]
    return d


def cmd_bench_serve(args: argparse.Namespace) -> dict:
    from tidal.model.registry import resolve_model
    from tidal.model.tokenizer import Tokenizer

    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per request
    with flag_errors("bench serve"):
        slos = parse_goodput(args.goodput)
        metrics, percentiles = report_options(args)
        target = request_target(args)
        header = result_header(args, args.backend, "")
        if args.num_warmups < 0:
            raise ValueError("--num-warmups must be >= 0")
        tokenizer = Tokenizer(resolve_model(args.tokenizer, check=False)[0])
        requests, times, _ = load_workload(args, tokenizer.vocab_size, tokenizer)
    served = wait_ready(target, args.ready_check_timeout_sec)
    target.model = target.model or served
    if args.num_warmups:
        warmups = warmup_requests(requests, args.num_warmups, tokenizer.vocab_size, args.seed)
        prefix = target.request_id_prefix  # their ids apart from the run's
        warm = replace(target, request_id_prefix=None if prefix is None else prefix + "warmup-")
        _, done = bench_serve(warm, tokenizer, warmups, [0.0] * len(warmups),
                              args.max_concurrency)
        failed = sum(not r.success for r in done)
        print(f"warm-up: {len(done)} requests" + (f", {failed} failed" if failed else ""))
    if args.flush_cache:
        print(f"prefix cache flushed: {flush_cache(target)}")
    if args.profile:
        post_control(target, ("/start_profile",), "--profile")
    before, wall_start = spec_counters(target.base_url), time.time()
    summary, results = bench_serve(target, tokenizer, requests, times, args.max_concurrency,
                                   slos, not args.disable_tqdm, percentiles)
    if args.profile:
        post_control(target, ("/stop_profile",), "--profile")
    result = {**header, "model_id": target.model, "tokenizer_id": args.tokenizer, **summary}
    result["spec_decode"] = spec_summary(before, spec_counters(target.base_url))
    ramp = ramp_up(args)
    if ramp:
        result["rps_change_events"] = rps_change_events(
            ramp_rates(*ramp, len(requests)), [r.start for r in results], wall_start)
    result["generated_texts"] = [r.text for r in results]
    print(format_report(result, metrics=metrics, percentiles=percentiles))
    errors = [r.error for r in results if r.error]
    if errors:
        print(f"{len(errors)} requests failed; the first: {errors[0]}")
    path = save_result(args, result, "bench")
    if path:
        print(f"result: {path}")
    if args.plot:
        from tidal.bench.plot import plot_results

        for f in plot_results(results, args.plot, "bench"):
            print(f"plot: {f}")
    return result
