"""The `tidal` command. `tidal generate PROMPT...` runs the offline engine, `tidal serve` the
OpenAI-compatible server, `tidal run-batch -i IN -o OUT` a Batch API file through that
server's app in process; every engine option (docs/configuration.md) is a flag: --dtype,
--num-kv-blocks, --policy, ... (made by tidal/engine/flags.py)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import time
from dataclasses import replace
from pathlib import Path

from tidal.engine.flags import (add_config_flags, add_engine_flags, config_from_args,
                                engine_kwargs, flag_errors)
from tidal.engine.vllm_flags import (add_vllm_flags, apply_vllm_flags, expand_config_file,
                                     model_word)
from tidal.server.config import HttpConfig, ServerConfig


def cmd_generate(args: argparse.Namespace) -> None:
    from tidal import LLM, SamplingParams

    with flag_errors("generate"):
        llm = LLM(**engine_kwargs(args))
        given = {k: getattr(args, k) for k in ("max_tokens", "temperature", "top_p", "top_k")
                 if getattr(args, k) is not None}  # unset: the model's, else greedy, 64
        params = replace(SamplingParams(**{"max_tokens": 64, "temperature": 0.0,
                                           **llm.engine.sampling_defaults}),
                         **given, seed=args.seed_per_request, lora=args.lora)
        t0 = time.perf_counter()  # (an unknown adapter is refused here)
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
    with flag_errors("serve"):
        server = config_from_args(ServerConfig, args)
        server.middleware_objects()  # a path that does not import ends the command now
    if server.pd is not None:
        return _serve_pd(args, server)
    started = _start_cores(args, server, "serve")
    if started is None:
        return
    client, server = started
    from tidal.server.api import build_app
    from tidal.server.limits import run_server

    run_server(build_app(client, server), server, client.stop_holding,
               timeout_graceful_shutdown=int(server.drain_timeout))


def cmd_run_batch(args: argparse.Namespace) -> None:
    """vLLM's run-batch: OpenAI Batch API lines from a JSONL file through the same app that
    `serve` answers with, in process; their answers to another JSONL file."""
    with flag_errors("run-batch"):
        server = config_from_args(ServerConfig, args)
        server.middleware_objects()
    if server.headless or server.pd is not None:
        raise SystemExit("tidal run-batch: error: it answers in one process: --headless and "
                         "--pd are for tidal serve")
    client, server = _start_cores(args, server, "run-batch")
    from tidal.server.api import build_app
    from tidal.server.batches.offline import run_batch

    app = build_app(client, server, batches=False)  # no online batches: this one file
    counts = asyncio.run(run_batch(app, args.input, args.output, server.max_pending))
    print(f"{counts['lines']} requests: {counts['ok']} answered, {counts['failed']} failed; "
          f"written to {args.output}")


def _start_cores(args: argparse.Namespace, server: ServerConfig, command: str):
    """The engine cores for `serve` and `run-batch`, launched, with the server config that
    names the served model; None on a headless node (its ranks served until stopped)."""
    from tidal.core.roles import ROLES
    from tidal.engine.config import EngineConfig
    from tidal.model.registry import locate_model, pending, write_model_files
    from tidal.model.tokenizer import Tokenizer, tokenizer_folder
    from tidal.runtime.client import CoreClient

    with flag_errors(command):
        config = EngineConfig.from_kwargs(**engine_kwargs(args))
    if ROLES[config.scheduler.role].transfers_kv and config.parallel.data_parallel_size > 1:
        raise SystemExit("a prefill or decode instance runs one engine core; run several "
                         "instances behind `tidal router` instead of --data-parallel-size")
    taken = set(server.served_model_name) & set(config.lora.modules)
    if taken:
        raise SystemExit(f"tidal {command}: error: {', '.join(sorted(taken))} names both the "
                         f"model (--served-model-name) and a LoRA adapter (--lora-modules)")
    if server.headless != (config.parallel.node_rank > 0):
        raise SystemExit("tidal serve: error: --headless is for the nodes of --node-rank 1 "
                         "and up (node 0 serves the API), and they take it")
    t0 = time.perf_counter()
    with flag_errors(command):
        files = locate_model(config.model.model)
    if server.headless:  # this machine's ranks of node 0's group, and nothing else
        from tidal.engine.tp_executor import serve_node

        with flag_errors(command):
            folder = write_model_files(files)
        serve_node(config.parallel, folder)
        return None
    # The cores import the engine and load while this process converts a new GGUF, reads
    # its tokenizer and builds the HTTP app (a GGUF's cores wait for the files if need be).
    own = config.model.tokenizer is None  # a GGUF's own is read once it is converted

    def tokenizer_of(folder) -> Tokenizer:  # with the server's template settings
        return Tokenizer(folder, server.chat_template, server.chat_template_defaults(),
                         server.chat_template_content_format)

    with flag_errors(command):  # a --chat-template that is no template fails here
        tokenizer = None if files.gguf and own else tokenizer_of(
            tokenizer_folder(config.model.tokenizer, files.folder))
    client = CoreClient(config, str(files.folder), tokenizer, server.restart_policy(),
                        files_pending=pending(files))
    client.launch()
    with flag_errors(command):
        folder = write_model_files(files)
    logging.getLogger("tidal.server").info("model files ready in %.2fs: %s",
                                           time.perf_counter() - t0, folder)
    if not server.served_model_name:
        server = replace(server, served_model_name=(files.name,))
    if client.tokenizer is None:
        with flag_errors(command):
            client.attach_tokenizer(tokenizer_of(folder))
    return client, server


def _serve_pd(args: argparse.Namespace, server) -> None:
    """`--pd xPyD`: x prefill and y decode instances as child processes on free loopback
    ports, and the router on --port in this one."""
    import subprocess

    import uvicorn

    from tidal.model.hosts import free_port
    from tidal.model.registry import resolve_model
    from tidal.server.limits import uvicorn_options
    from tidal.server.pd_router import PDRouter
    from tidal.server.pd_routes import build_router_app

    resolve_model(engine_kwargs(args).get("model", "smollm2-135m"))  # convert once, up front
    passed = _strip_flags(args.argv, ("--pd", "--port", "--host", "--role", *FRONT_FLAGS))
    children, urls = [], {"prefill": [], "decode": []}
    for role, count in zip(("prefill", "decode"), server.pd_counts):
        for _ in range(count):
            port = free_port()
            children.append(subprocess.Popen([sys.executable, "-m", "tidal.cli", *passed,
                                              "--role", role, "--port", str(port)]))
            urls[role].append(f"http://127.0.0.1:{port}")

    def stop_children() -> None:
        for child in children:
            child.terminate()
        for child in children:
            try:
                child.wait(timeout=server.drain_timeout + 15)
            except subprocess.TimeoutExpired:
                child.kill()
    router = PDRouter(urls["prefill"], urls["decode"])
    try:
        uvicorn.run(build_router_app(router, server, stop_children),
                    **uvicorn_options(server))
    finally:
        stop_children()


# The router's alone under --pd: its instances listen on loopback, plain HTTP, for it.
FRONT_FLAGS = ("--uds", "--ssl-keyfile", "--ssl-certfile", "--ssl-ca-certs", "--ssl-cert-reqs",
               "--root-path", "--allowed-origins", "--allowed-methods", "--allowed-headers",
               "--allow-credentials")


def _strip_flags(argv: list[str], flags: tuple[str, ...]) -> list[str]:
    """argv without these flags and their values (--flag value..., --flag=value; `tidal
    serve` takes no positional argument a value could be mistaken for)."""
    out, skip = [], False
    for arg in argv:
        if skip and not arg.startswith("--"):
            continue
        skip = arg in flags
        if not skip and not arg.startswith(tuple(f + "=" for f in flags)):
            out.append(arg)
    return out


def cmd_router(args: argparse.Namespace) -> None:
    import uvicorn

    from tidal.server.limits import uvicorn_options
    from tidal.server.pd_router import PDRouter
    from tidal.server.pd_routes import build_router_app

    with flag_errors("router"):
        http = config_from_args(HttpConfig, args)
    app = build_router_app(PDRouter(args.prefill, args.decode), http)
    uvicorn.run(app, **uvicorn_options(http))


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
    given = list(argv) if argv is not None else sys.argv[1:]
    expanded = given
    if given[:1] in (["serve"], ["run-batch"]):  # vLLM's command lines too (vllm_flags.py)
        expanded = expand_config_file(model_word(given) if given[0] == "serve" else given)
    args = build_parser().parse_args(expanded)
    args.argv = expanded  # (a --pd instance gets the config file's flags as flags)
    with flag_errors(args.command):
        apply_vllm_flags(args)
    logging.basicConfig(level=getattr(args, "log_level", "info").upper(),
                        format="%(asctime)s %(name)s: %(message)s")
    return args.func(args)


def build_parser() -> argparse.ArgumentParser:
    """The `tidal` command's parser, every subcommand with its flags."""
    parser = argparse.ArgumentParser(prog="tidal", description="tidal: an LLM serving engine")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate for prompts offline, batched")
    gen.add_argument("prompts", nargs="+", help="prompts (sent as chat messages unless --raw)")
    gen.add_argument("--raw", action="store_true", help="send prompts as plain text")
    model_default = "(default: the model's generation config, else %s)"
    gen.add_argument("--max-tokens", type=int, help=model_default % 64)
    gen.add_argument("--temperature", type=float, help=model_default % "0: greedy")
    gen.add_argument("--top-p", type=float, help=model_default % 1.0)
    gen.add_argument("--top-k", type=int, help=model_default % "0: all")
    gen.add_argument("--seed-per-request", type=int, default=None,
                     help="sampling seed of every request")
    gen.add_argument("--lora", default=None, metavar="NAME",
                     help="the LoRA adapter (of --lora-modules) that serves every prompt")
    add_engine_flags(gen)
    gen.set_defaults(func=cmd_generate)
    srv = sub.add_parser("serve", help="serve the OpenAI-compatible API",
                         usage="tidal serve [MODEL] [flags] (MODEL first: as --model)")
    add_config_flags(srv, ServerConfig, "server options")
    add_engine_flags(srv)
    add_vllm_flags(srv)
    srv.set_defaults(func=cmd_serve)
    batch = sub.add_parser("run-batch", help="answer an OpenAI Batch API JSONL file offline")
    batch.add_argument("-i", "--input", required=True, help="the requests: one JSON object "
                       "a line (custom_id, method, url, body)")
    batch.add_argument("-o", "--output", required=True, help="the answers, one a line, in "
                       "the input's order")
    add_config_flags(batch, ServerConfig, "server options")
    add_engine_flags(batch)
    add_vllm_flags(batch)
    batch.set_defaults(func=cmd_run_batch)
    rtr = sub.add_parser("router", help="route requests over running prefill and decode "
                                        "instances (P/D disaggregation)")
    rtr.add_argument("--prefill", nargs="+", required=True, metavar="URL",
                     help="`tidal serve --role prefill` instances")
    rtr.add_argument("--decode", nargs="+", required=True, metavar="URL",
                     help="`tidal serve --role decode` instances")
    add_config_flags(rtr, HttpConfig, "HTTP options")
    rtr.set_defaults(func=cmd_router)
    from tidal.client_cli import add_client_parsers

    add_client_parsers(sub)
    from tidal.bench.serve import add_bench_serve_parser

    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench",
                                                                      required=True)
    add_bench_serve_parser(bench)
    from tidal.sim.cli import add_calibrate_parser, add_simulate_parser

    add_simulate_parser(sub)
    sub.choices["simulate"].set_defaults(func=cmd_simulate)
    add_calibrate_parser(sub)
    return parser


if __name__ == "__main__":
    main()
