"""The `tidal` command. `tidal generate PROMPT...` runs the offline engine; every engine
option (see the README's knobs tables) is a flag: --dtype, --num-kv-blocks, --policy, ..."""

from __future__ import annotations

import argparse
import logging
import time
from typing import Any

from tidal.engine.config import all_fields


def _parse_bool(text: str) -> bool:
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per engine config field, typed from its default."""
    group = parser.add_argument_group("engine options")
    for name, default, help_text in all_fields():
        flag = "--" + name.replace("_", "-")
        if isinstance(default, bool):
            kind = _parse_bool
        elif isinstance(default, (int, float)):
            kind = type(default)
        elif name in ("num_kv_blocks", "kv_cache_memory", "num_threads"):
            kind = int
        else:
            kind = str
        group.add_argument(flag, dest=name, type=kind, default=argparse.SUPPRESS,
                           help=f"{help_text} (default: {default})")


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    names = {name for name, _, _ in all_fields()}
    return {k: v for k, v in vars(args).items() if k in names}


def cmd_generate(args: argparse.Namespace) -> None:
    from tidal import LLM, SamplingParams

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


def main(argv: list[str] | None = None) -> None:
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
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    args.func(args)


if __name__ == "__main__":
    main()
