"""The `tidal` command. `tidal generate PROMPT...` runs the offline engine, `tidal serve` the
OpenAI-compatible server; every engine option (docs/configuration.md) is a flag: --dtype,
--num-kv-blocks, --policy, ... (made by tidal/engine/flags.py)."""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

from tidal.engine.flags import add_engine_flags, engine_kwargs, flag_errors
from tidal.server.openai.reasoning import PARSERS as REASONING_PARSERS


def cmd_generate(args: argparse.Namespace) -> None:
    from tidal import LLM, SamplingParams

    with flag_errors("generate"):
        llm = LLM(**engine_kwargs(args))
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                                top_p=args.top_p, top_k=args.top_k, seed=args.seed_per_request)
    t0 = time.perf_counter()
    if args.raw:
        outs = llm.generate(args.prompts, params)
    else:
        outs = llm.chat([[{"role": "user", "content": p}] for p in args.prompts], params)
    elapsed = time.perf_counter() - t0
    tokens = 0
    for prompt, out in zip(args.prompts, outs):
        o = out.outputs[0]
        tokens += len(o.token_ids)
        print(f"\n>>> {prompt}\n{o.text.strip()}\n[{len(o.token_ids)} tokens, {o.finish_reason}]")
    print(f"\n{tokens} tokens in {elapsed:.2f}s: {tokens / elapsed:.1f} tokens/s "
          f"({len(outs)} requests batched)")


def cmd_serve(args: argparse.Namespace) -> None:
    import uvicorn

    if args.pd:
        return _serve_pd(args)
    from tidal.core.roles import ROLES
    from tidal.engine.config import EngineConfig
    from tidal.model.registry import resolve_model
    from tidal.model.tokenizer import Tokenizer
    from tidal.server.api import ServerConfig, build_app
    from tidal.runtime.client import CoreClient
    from tidal.server.limits import uvicorn_limits
    from tidal.runtime.core_watch import RestartPolicy

    with flag_errors("serve"):
        config = EngineConfig.from_kwargs(**engine_kwargs(args))
    if ROLES[config.scheduler.role].transfers_kv and config.parallel.data_parallel_size > 1:
        raise SystemExit("a prefill or decode instance runs one engine core; run several "
                         "instances behind `tidal router` instead of --data-parallel-size")
    with flag_errors("serve"):
        folder, name = resolve_model(config.model.model)  # converts once, before the core starts
    with flag_errors("serve"):
        restart = RestartPolicy(args.restart_core, args.restart_backoff)
    client = CoreClient(config, str(folder), Tokenizer(folder), restart)
    server = ServerConfig(model_name=args.served_model_name or name, api_key=args.api_key,
                          max_pending=args.max_pending, max_n=args.max_n,
                          drain_timeout=args.drain_timeout, max_body_bytes=args.max_body_bytes,
                          max_total_tokens=args.max_total_tokens,
                          max_stop_strings=args.max_stop_strings,
                          max_stop_length=args.max_stop_length,
                          max_header_bytes=args.max_header_bytes, idle_timeout=args.idle_timeout,
                          tool_call_parser=args.tool_call_parser,
                          reasoning_parser=args.reasoning_parser)
    uvicorn.run(build_app(client, server), host=args.host, port=args.port,
                log_level="info", timeout_graceful_shutdown=int(args.drain_timeout),
                **uvicorn_limits(server.max_header_bytes, server.idle_timeout))


def _serve_pd(args: argparse.Namespace) -> None:
    """`--pd xPyD`: x prefill and y decode instances as child processes on free loopback
    ports, and the router on --port in this one."""
    import re
    import subprocess

    import uvicorn

    from tidal.server.limits import uvicorn_limits
    from tidal.server.pd_router import PDRouter, build_router_app
    from tidal.model.registry import resolve_model

    match = re.fullmatch(r"(\d+)P(\d+)D", args.pd)
    if not match or min(int(match[1]), int(match[2])) < 1:
        raise SystemExit(f"--pd expects xPyD with x, y >= 1 (e.g. 1P1D); got {args.pd!r}")
    resolve_model(engine_kwargs(args).get("model", "smollm2-135m"))  # convert once, up front
    passed = _strip_flags(args.argv, ("--pd", "--port", "--host", "--role"))
    children, urls = [], {"prefill": [], "decode": []}
    for role, count in (("prefill", int(match[1])), ("decode", int(match[2]))):
        for _ in range(count):
            port = _free_port()
            children.append(subprocess.Popen([sys.executable, "-m", "tidal.cli", *passed,
                                              "--role", role, "--port", str(port)]))
            urls[role].append(f"http://127.0.0.1:{port}")

    def stop_children() -> None:
        for child in children:
            child.terminate()
        for child in children:
            try:
                child.wait(timeout=args.drain_timeout + 15)
            except subprocess.TimeoutExpired:
                child.kill()
    router = PDRouter(urls["prefill"], urls["decode"])
    try:
        uvicorn.run(build_router_app(router, stop_children, args.api_key, args.max_body_bytes,
                                     args.max_header_bytes),
                    host=args.host, port=args.port, log_level="info",
                    **uvicorn_limits(args.max_header_bytes, args.idle_timeout))
    finally:
        stop_children()


def _strip_flags(argv: list[str], flags: tuple[str, ...]) -> list[str]:
    """argv without these flags and their values (both --flag value and --flag=value)."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in flags:
            skip = True
        elif not arg.startswith(tuple(f + "=" for f in flags)):
            out.append(arg)
    return out


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cmd_router(args: argparse.Namespace) -> None:
    import uvicorn

    from tidal.server.limits import uvicorn_limits
    from tidal.server.pd_router import PDRouter, build_router_app

    router = PDRouter(args.prefill, args.decode)
    app = build_router_app(router, api_key=args.api_key, max_body_bytes=args.max_body_bytes,
                           max_header_bytes=args.max_header_bytes)
    uvicorn.run(app, host=args.host, port=args.port, log_level="info",
                **uvicorn_limits(args.max_header_bytes, args.idle_timeout))


def _add_connection_limits(parser: argparse.ArgumentParser) -> None:
    """The limits every tidal HTTP front enforces (`tidal serve` and `tidal router`)."""
    parser.add_argument("--max-body-bytes", type=int, default=8 * 1024 * 1024,
                        help="largest request body; larger ones get HTTP 413")
    parser.add_argument("--max-header-bytes", type=int, default=16 * 1024,
                        help="largest request line plus headers; larger ones get HTTP 431")
    parser.add_argument("--idle-timeout", type=float, default=5.0,
                        help="seconds a connection may sit idle, before its first request or "
                             "between requests, before the server closes it")


def cmd_simulate(args: argparse.Namespace) -> dict:
    """`tidal simulate`, and with --dashboard the page replaying it (the page is the
    server's, which the simulator's layer may not import)."""
    from tidal.server.dashboard import page_html
    from tidal.sim.cli import cmd_simulate as simulate

    result = simulate(args)
    if args.dashboard:
        title = f"tidal simulate: {args.model_config} on {args.hardware}"
        Path(args.dashboard).write_text(page_html(result["dashboard_frames"], title))
        print(f"dashboard: {args.dashboard}")
    return result


def main(argv: list[str] | None = None) -> None:
    """The console script: runs a command (its result is for `run` callers, not the exit
    status)."""
    run(argv)


def run(argv: list[str] | None = None):
    """Parse `argv` and run the command; returns what the command returns (a benchmark's or
    a simulation's result dict)."""
    parser = argparse.ArgumentParser(prog="tidal", description="tidal: an LLM serving engine")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate for prompts offline, batched")
    gen.add_argument("prompts", nargs="+", help="prompts (sent as chat messages unless --raw)")
    gen.add_argument("--raw", action="store_true", help="send prompts as plain text")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed-per-request", type=int, default=None,
                     help="sampling seed of every request")
    add_engine_flags(gen)
    gen.set_defaults(func=cmd_generate)
    srv = sub.add_parser("serve", help="serve the OpenAI-compatible API")
    srv.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback)")
    srv.add_argument("--port", type=int, default=8000)
    srv.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY'")
    srv.add_argument("--served-model-name", default=None,
                     help="the model name clients send (default: the model's own)")
    srv.add_argument("--max-pending", type=int, default=512,
                     help="requests in flight before new ones get HTTP 429")
    srv.add_argument("--max-n", type=int, default=16, help="largest n a request may ask for")
    srv.add_argument("--drain-timeout", type=float, default=30.0,
                     help="seconds SIGTERM lets running requests finish")
    srv.add_argument("--max-total-tokens", type=int, default=None,
                     help="most output tokens one prompt may ask for, n x max_tokens "
                          "(default: no cap beyond --max-n and the context)")
    srv.add_argument("--max-stop-strings", type=int, default=16,
                     help="most stop strings a request may send")
    srv.add_argument("--max-stop-length", type=int, default=256,
                     help="most characters of one stop string")
    srv.add_argument("--tool-call-parser", default="auto",
                     choices=("auto", "hermes", "llama3_json"),
                     help="how tool_choice 'auto' reads the model's calls: <tool_call> JSON "
                          "(hermes: Qwen, Hermes, and models without a tool template), "
                          "Llama 3 JSON, or auto (from the chat template)")
    srv.add_argument("--reasoning-parser", default=None, choices=REASONING_PARSERS,
                     help="split <think> blocks from replies into reasoning_content "
                          "(qwen3 and deepseek_r1 name the same parser)")
    _add_connection_limits(srv)
    srv.add_argument("--restart-core", type=int, default=3, metavar="N",
                     help="restart a dead engine core up to N times in a row (0: never); its "
                          "in-flight requests fail, new ones get 503 until it is back")
    srv.add_argument("--restart-backoff", type=float, default=1.0, metavar="SECONDS",
                     help="wait before the first restart, doubled for each next one")
    srv.add_argument("--pd", default=None, metavar="xPyD",
                     help="prefill/decode disaggregation on this machine: start x prefill and "
                          "y decode instances (e.g. 1P1D) and serve the router on --port")
    add_engine_flags(srv)
    srv.set_defaults(func=cmd_serve)
    rtr = sub.add_parser("router", help="route requests over running prefill and decode "
                                        "instances (P/D disaggregation)")
    rtr.add_argument("--prefill", nargs="+", required=True, metavar="URL",
                     help="`tidal serve --role prefill` instances")
    rtr.add_argument("--decode", nargs="+", required=True, metavar="URL",
                     help="`tidal serve --role decode` instances")
    rtr.add_argument("--host", default="127.0.0.1")
    rtr.add_argument("--port", type=int, default=8000)
    rtr.add_argument("--api-key", default=None,
                     help="require 'Authorization: Bearer KEY' (forwarded to the instances)")
    _add_connection_limits(rtr)
    rtr.set_defaults(func=cmd_router)
    from tidal.bench.serve import add_bench_serve_parser

    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench",
                                                                      required=True)
    add_bench_serve_parser(bench)
    from tidal.sim.cli import add_calibrate_parser, add_simulate_parser

    add_simulate_parser(sub)
    sub.choices["simulate"].set_defaults(func=cmd_simulate)
    add_calibrate_parser(sub)
    args = parser.parse_args(argv)
    args.argv = list(argv) if argv is not None else sys.argv[1:]
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    return args.func(args)


if __name__ == "__main__":
    main()
