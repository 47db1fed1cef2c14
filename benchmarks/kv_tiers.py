"""The disk tier under the prefix cache on the served path: multi-turn conversations (real
ShareGPT turns, each prompt the whole history so far, every conversation's turn t before any
turn t + 1), or shared-prefix groups (`--shared-prefix CHARS`: each group a document of
ShareGPT replies, then one ShareGPT question a turn), through `tidal serve` with a KV pool a
quarter of the working set, with the disk tier (`--kv-cache-dir`) against without; then a
restart: the last turn of conversations seen before, sent to the restarted tiered server
one at a time, against a cold server without the tier.

usage: .venv/bin/python benchmarks/kv_tiers.py [--conversations 32] [--turns 4]
  [--concurrency 8] [--message-chars 600] [--max-tokens 16] [--restart-prompts 8]
  [--shared-prefix 0] [--own-replies]

`--own-replies`: each turn's prompt is the conversation so far with the server's own
replies (as a chat client sends it back, and as SGLang's multi-turn benchmark builds it):
a returning user's prompt then starts with KV the server computed, replies included.

Targets (issue 57): TTFT p50 >= 3x better and throughput >= 1.5x with the tier; after a
restart, TTFT >= 3x better than cold; no request whose prefix loaded slower than computing
it (per request, restart phase: tiered TTFT <= cold TTFT).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

from server_fixtures import Server, metric  # noqa: E402
from tidal.bench.dataset import iter_json_records, sharegpt_path  # noqa: E402

BLOCK = 16


def conversations(count: int, turns: int, chars: int, own: bool = False) -> list[list[str]]:
    """`count` ShareGPT conversations of at least `turns` exchanges: for each, the prompt of
    every turn (the history of earlier turns with their recorded replies, then the next
    user message; `own`: the user message alone, the history to come from the server's
    replies), messages cut to `chars` characters."""
    out = []
    for record in iter_json_records(sharegpt_path().read_text()):
        msgs = record.get("conversations") or []
        pairs = list(zip(msgs[0::2], msgs[1::2]))
        if len(pairs) < turns or any(h.get("from") != "human" or g.get("from") != "gpt"
                                     for h, g in pairs[:turns]):
            continue
        history, prompts = "", []
        for human, gpt in pairs[:turns]:
            question = f"User: {human['value'][:chars]}\nAssistant:"
            prompts.append(question if own else f"{history}{question}")
            history = f"{prompts[-1]} {gpt['value'][:chars]}\n"
        out.append(prompts)
        if len(out) == count:
            break
    return out


def shared_prefix_groups(count: int, turns: int, chars: int,
                         question_chars: int) -> list[list[str]]:
    """`count` groups of `turns` prompts: a document of `chars` characters (ShareGPT
    replies, a group's own), then one ShareGPT question each (cut to `question_chars`)."""
    replies, questions = [], []
    for record in iter_json_records(sharegpt_path().read_text()):
        for msg in record.get("conversations") or []:
            (questions if msg.get("from") == "human" else replies).append(msg.get("value", ""))
        if len(questions) >= count * turns and sum(map(len, replies)) >= count * chars:
            break
    text = "\n".join(replies)
    return [[f"Document:\n{text[g * chars:(g + 1) * chars]}\n\nUser: "
             f"{questions[g * turns + t][:question_chars]}\nAssistant:" for t in range(turns)]
            for g in range(count)]


async def _ttft(client, prompt: str, max_tokens: int) -> tuple[float, str]:
    """The request's TTFT and its text."""
    t0 = time.perf_counter()
    stream = await client.completions.create(model="smollm2-135m", prompt=prompt,
                                             max_tokens=max_tokens, temperature=0.0,
                                             stream=True, extra_body={"ignore_eos": True})
    first, text = None, []
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            if first is None:
                first = time.perf_counter() - t0
            text.append(chunk.choices[0].text)
    return (first if first is not None else time.perf_counter() - t0), "".join(text)


def _client(url: str):
    import openai

    return openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0,
                              timeout=900)


async def multi_turn(url: str, convs: list[list[str]], concurrency: int,
                     max_tokens: int, own: bool = False) -> tuple[list[float], float]:
    """Turn by turn, every conversation's next turn, `concurrency` requests at a time (as
    users who come back after the others spoke: a conversation's history is evicted from
    a pool a quarter of the working set before its next turn); the TTFTs and the wall
    seconds. `own`: `convs` holds each turn's question alone ("User: ...\nAssistant:"),
    and a turn's prompt is the conversation so far with the server's own replies (as a chat
    client sends it); the prompts sent are written back into `convs`, so that another
    server can be sent the very same ones."""
    ttfts: list[float] = []
    history = [""] * len(convs)
    async with _client(url) as client:
        t0 = time.perf_counter()
        for turn in range(len(convs[0])):
            if own:
                for i, c in enumerate(convs):
                    c[turn] = history[i] + c[turn]
            queue = list(range(len(convs)))

            async def worker():
                while queue:
                    i = queue.pop(0)
                    ttft, text = await _ttft(client, convs[i][turn], max_tokens)
                    ttfts.append(ttft)
                    history[i] = f"{convs[i][turn]}{text}\n"

            await asyncio.gather(*(worker() for _ in range(concurrency)))
        return ttfts, time.perf_counter() - t0


async def one_by_one(url: str, prompts: list[str], max_tokens: int) -> list[float]:
    async with _client(url) as client:
        return [(await _ttft(client, p, max_tokens))[0] for p in prompts]


def save_profile(blocks: int) -> None:
    """A server of this pool left idle until its step-time profile is saved, so that every
    measured server reads it back instead of timing shapes between the requests."""
    server = Server("--num-kv-blocks", str(blocks), "--num-threads", str(os.cpu_count() or 1))
    try:
        deadline = time.monotonic() + 180
        # none measured before serving: an earlier start's profile was read back
        while ("before serving" in server.output() and "saved to" not in server.output()
               and time.monotonic() < deadline):
            time.sleep(1)
    finally:
        server.stop()


def serve(blocks: int, tier: Path | None) -> Server:
    flags = ["--num-kv-blocks", str(blocks), "--num-threads", str(os.cpu_count() or 1)]
    if tier is not None:
        flags += ["--kv-cache-dir", str(tier)]
    server = Server(*flags)
    warm = [f"User: warm-up {i} " + "lorem ipsum " * 40 + "\nAssistant:" for i in range(4)]
    asyncio.run(one_by_one(server.url, warm, 4))  # warmed up alike, prompts unlike the rest
    return server


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--conversations", type=int, default=32)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--message-chars", type=int, default=600)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--restart-prompts", type=int, default=8)
    p.add_argument("--shared-prefix", type=int, default=0,
                   help="characters of each group's document (0: conversations)")
    p.add_argument("--own-replies", action="store_true",
                   help="conversations whose history holds the server's own replies (of "
                   "--max-tokens), as a chat client sends it, not ShareGPT's recorded ones")
    args = p.parse_args()
    own = args.own_replies and not args.shared_prefix
    convs = (shared_prefix_groups(args.conversations, args.turns, args.shared_prefix,
                                  args.message_chars) if args.shared_prefix else
             conversations(args.conversations, args.turns, args.message_chars, own))
    # the working set: every conversation's longest prompt, in blocks (about 4 characters
    # a token), plus its reply; the pool holds a quarter of it
    working = sum(((sum(map(len, c)) if own else len(c[-1])) // 4
                   + args.max_tokens * (len(c) if own else 1)) // BLOCK + 1 for c in convs)
    blocks = max(64, working // 4)
    kind = "shared-prefix groups" if args.shared_prefix else "conversations"
    print(f"{len(convs)} {kind} x {args.turns} turns, working set ~{working} blocks, "
          f"pool {blocks} blocks")
    save_profile(blocks)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        tier = Path(tmp) / "kv"
        for name, folder in (("off", None), ("disk tier", tier)):
            server = serve(blocks, folder)
            try:  # own replies: the first server's prompts, replayed to the second
                ttfts, seconds = asyncio.run(multi_turn(server.url, convs, args.concurrency,
                                                        args.max_tokens, own))
                own = False
                time.sleep(1)  # the core's stats reach /metrics twice a second
                loaded = (metric(server.url, "tidal:kv_disk_loaded_blocks_total")
                          if folder else 0)
                load_ms = (metric(server.url, "tidal:kv_disk_load_seconds_per_block") * 1000
                           if folder else 0)
                computed = metric(server.url, "tidal:prompt_tokens_total")
            finally:
                server.stop()
            results[name] = (statistics.median(ttfts), len(ttfts) / seconds, loaded,
                             load_ms, computed)
        last = [c[-1] for c in convs[:args.restart_prompts]]
        restarted = serve(blocks, tier)  # the folder the tiered run left
        try:
            warm = asyncio.run(one_by_one(restarted.url, last, args.max_tokens))
        finally:
            restarted.stop()
        cold_server = serve(blocks, None)
        try:
            cold = asyncio.run(one_by_one(cold_server.url, last, args.max_tokens))
        finally:
            cold_server.stop()
    (off_p50, off_rate, *_), (on_p50, on_rate, *_) = results["off"], results["disk tier"]
    print("\n| run | TTFT p50 | requests/s | blocks loaded | ms a block | prompt tokens "
          "computed |\n|---|---|---|---|---|---|")
    for name, (p50, rate, count, load_ms, computed) in results.items():
        print(f"| {name} | {p50 * 1000:.0f} ms | {rate:.2f} | {count:.0f} | {load_ms:.2f} | "
              f"{computed:.0f} |")
    print(f"| tier / off | {off_p50 / on_p50:.2f}x better | {on_rate / off_rate:.2f}x | | | |")
    ratios = [c / w for c, w in zip(cold, warm)]
    print(f"\nrestart, the last turn of {len(last)} conversations one at a time: TTFT p50 "
          f"{statistics.median(warm) * 1000:.0f} ms restarted with the tier, "
          f"{statistics.median(cold) * 1000:.0f} ms cold: {statistics.median(cold) / statistics.median(warm):.2f}x; "
          f"per request {min(ratios):.2f}-{max(ratios):.2f}x "
          f"({sum(r < 1 for r in ratios)} slower than computing)")


if __name__ == "__main__":
    main()
