"""`tidal bench serve`: drive an OpenAI-compatible server with a workload and report TTFT,
TPOT, ITL, E2E latency, throughput and goodput (the JSON keys of `vllm bench serve`)."""

from __future__ import annotations

import argparse
import asyncio
import logging

from tidal.bench.client import Target, run_workload
from tidal.bench.dataset import BenchRequest
from tidal.bench.flags import add_workload_flags, load_workload, result_header, save_result
from tidal.bench.metrics import RequestResult, format_report, parse_goodput, summarize
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
    add_workload_flags(p)
    p.set_defaults(func=cmd_bench_serve)


def prompt_text(tokenizer, ids: list[int]) -> str:
    """Text that the server tokenizes back into as many tokens as `ids` (the simulator
    replays the ids): synthetic ids decode to text that re-encodes to more tokens (+3.5% on
    random 128-token prompts), so re-encode once and keep the first len(ids), as vLLM's
    random dataset does; measured exact for 200 of 200 such prompts."""
    text = tokenizer.decode(ids)
    return tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)[:len(ids)])


def bench_serve(target: Target, tokenizer, requests: list[BenchRequest], times: list[float],
                max_concurrency: int | None = None, slos: dict[str, float] | None = None,
                progress: bool = False) -> tuple[dict, list[RequestResult]]:
    """Send `requests` to `target` at `times` (seconds from the start), at most
    `max_concurrency` at once, with prompts made by `tokenizer`; returns the summary (the
    vLLM keys, goodput under `slos`) and each request's result. `target.model` is filled in
    from the server when unset."""
    prompts = [r.text if r.text is not None else prompt_text(tokenizer, r.prompt_ids)
               for r in requests]
    results, duration = asyncio.run(run_workload(
        target, requests, prompts, times, max_concurrency, progress))
    return summarize(results, duration, slos), results


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


def flush_cache(target: Target) -> str:
    """Ask the server to forget its cached prefixes: vLLM's and tidal's
    /reset_prefix_cache, else SGLang's /flush_cache; the path that answered. SystemExit
    where neither does (llama-server; vLLM outside its dev mode)."""
    import httpx

    for path in ("/reset_prefix_cache", "/flush_cache"):
        try:
            r = httpx.post(target.base_url.rstrip("/") + path, headers=target.headers(),
                           timeout=60)
        except httpx.HTTPError as exc:
            raise SystemExit(f"bench serve: --flush-cache: {exc}") from None
        if r.status_code == 200:
            return path
    raise SystemExit(f"bench serve: --flush-cache: {target.base_url} has neither "
                     f"/reset_prefix_cache nor /flush_cache (last answer: {r.status_code})")


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
        tokenizer = Tokenizer(resolve_model(args.tokenizer, check=False)[0])
        requests, times, _ = load_workload(args, tokenizer.vocab_size, tokenizer)
    target = Target(base_url=args.base_url or f"http://{args.host}:{args.port}",
                    endpoint=args.endpoint, model=args.model, api_key=args.api_key,
                    ignore_eos=args.ignore_eos, temperature=args.temperature)
    if args.flush_cache:
        print(f"prefix cache flushed: {flush_cache(target)}")
    before = spec_counters(target.base_url)
    summary, results = bench_serve(target, tokenizer, requests, times, args.max_concurrency,
                                   slos, not args.disable_tqdm)
    result = result_header(args, args.backend, target.model)
    result["tokenizer_id"] = args.tokenizer
    result.update(summary)
    result["spec_decode"] = spec_summary(before, spec_counters(target.base_url))
    result["generated_texts"] = [r.text for r in results]
    print(format_report(result))
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
