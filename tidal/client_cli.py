"""`tidal chat` and `tidal complete` (vLLM's `vllm chat` / `vllm complete`): talk to a running
OpenAI-compatible server from a terminal, through the official `openai` client. `chat` keeps
the conversation and streams each answer; `complete` continues each line as a prompt.
`--quick TEXT` sends one message and exits (for scripts)."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Iterator


def add_client_parsers(sub) -> None:
    """The two subcommands and their flags."""
    for name, what in (("chat", "chat with a running server (a conversation)"),
                       ("complete", "complete prompts with a running server")):
        p = sub.add_parser(name, help=what)
        p.add_argument("--url", default="http://localhost:8000/v1",
                       help="the server's OpenAI base URL (default: %(default)s)")
        p.add_argument("--model-name", default=None,
                       help="the model to ask for (default: the server's first)")
        p.add_argument("--api-key", default=None,
                       help="the server's key (default: TIDAL_API_KEY, OPENAI_API_KEY)")
        p.add_argument("--max-tokens", type=int, default=None,
                       help="output tokens per answer (default: the server's)")
        p.add_argument("-q", "--quick", default=None, metavar="TEXT",
                       help="send this one message, print the answer, and exit")
        if name == "chat":
            p.add_argument("--system-prompt", default=None, help="the conversation's system "
                                                                  "message")
        p.set_defaults(func=cmd_chat if name == "chat" else cmd_complete)


def _client(args: argparse.Namespace):
    import openai

    logging.getLogger().setLevel(logging.WARNING)  # no log line per HTTP request here
    key = args.api_key or os.environ.get("TIDAL_API_KEY") or os.environ.get(
        "OPENAI_API_KEY") or "none"
    client = openai.OpenAI(base_url=args.url, api_key=key, max_retries=0)
    try:
        model = args.model_name or client.models.list().data[0].id
    except openai.APIConnectionError:
        raise SystemExit(f"tidal: no server answers at {args.url} (start one: tidal serve)")
    except openai.APIError as exc:
        raise SystemExit(f"tidal: the server answered: {exc}")
    return client, model


def _lines(quick: str | None, prompt: str) -> Iterator[str]:
    """The messages to send: --quick's one, else each line typed (or piped) until EOF."""
    if quick is not None:
        yield quick
        return
    while True:
        try:
            line = input(prompt if sys.stdin.isatty() else "")
        except EOFError:
            return
        if line.strip():
            yield line


def _stream(chunks, text_of) -> str:
    """Print a streamed answer as it comes; return it whole."""
    parts = []
    for chunk in chunks:
        if chunk.choices and (piece := text_of(chunk.choices[0])):
            parts.append(piece)
            print(piece, end="", flush=True)
    print(flush=True)
    return "".join(parts)


def _refused(exc: Exception, quick: bool) -> None:
    """A one-shot run ends with the server's words (exit status 1); a session goes on."""
    if quick:
        raise SystemExit(f"tidal: the server answered: {exc}")
    print(f"(the server answered: {exc})", file=sys.stderr)


def cmd_chat(args: argparse.Namespace) -> None:
    import openai

    client, model = _client(args)
    messages = [{"role": "system", "content": args.system_prompt}] if args.system_prompt else []
    if args.quick is None and sys.stdin.isatty():
        print(f"chatting with {model} at {args.url} (Ctrl-D to end)")
    for line in _lines(args.quick, "> "):
        messages.append({"role": "user", "content": line})
        try:
            answer = _stream(client.chat.completions.create(
                model=model, messages=messages, max_tokens=args.max_tokens, stream=True),
                lambda c: c.delta.content)
        except openai.APIError as exc:
            messages.pop()  # the turn did not happen
            _refused(exc, args.quick is not None)
            continue
        messages.append({"role": "assistant", "content": answer})


def cmd_complete(args: argparse.Namespace) -> None:
    import openai

    client, model = _client(args)
    for line in _lines(args.quick, "prompt> "):
        try:
            _stream(client.completions.create(model=model, prompt=line,
                                              max_tokens=args.max_tokens, stream=True),
                    lambda c: c.text)
        except openai.APIError as exc:
            _refused(exc, args.quick is not None)
