"""What `--deterministic` costs and what it buys, on the served path: `tidal serve` by
default, with `--deterministic`, and with `--deterministic --prompt-rounding once`, one
after the other, each warmed up alike and driven by `tidal bench serve` (random prompts of
fresh seeds, fixed output lengths, greedy) at each `--concurrency`, then one long prompt at
a time (its TTFT: the prefill). Agreement: each of a set of chat questions asked alone
(cold), alone again (its prompt now in the prefix cache) and among the others at once,
greedy with logprobs; a question agrees when its three answers carry the same tokens and
logprobs to the last bit.

usage: .venv/bin/python benchmarks/deterministic.py [--concurrency 1 16] [--prompts 32]
       [--prefill-len 1000] [--port 8124]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai

sys.path.insert(0, str(Path(__file__).resolve().parent))
from quantized import bench, start, stop  # noqa: E402  (start-and-wait, `tidal bench serve`)

MODES = {"default": [], "deterministic": ["--deterministic"],
         "deterministic, prompt rounded once": ["--deterministic", "--prompt-rounding", "once"]}
QUESTIONS = ["Explain in one paragraph how a hash map works.", "Write a haiku about the sea.",
             "What is the capital of France?", "List five prime numbers and say why.",
             "Tell me a short story about a lighthouse keeper.", "What is a B-tree?",
             "Give three tips for writing clean Python code.", "Why is the sky blue?"]


def agreement(port: int, max_tokens: int = 48) -> int:
    """How many QUESTIONS get the same bits cold, from the prefix cache and batched."""
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)

    def ask(q: str):
        out = client.chat.completions.create(
            model="smollm2-135m", messages=[{"role": "user", "content": q}], temperature=0,
            max_tokens=max_tokens, logprobs=True)
        return [(t.token, t.logprob) for t in out.choices[0].logprobs.content]

    cold = [ask(q) for q in QUESTIONS]
    cached = [ask(q) for q in QUESTIONS]
    with ThreadPoolExecutor(len(QUESTIONS)) as pool:
        batched = list(pool.map(ask, QUESTIONS))
    return sum(a == b == c for a, b, c in zip(cold, cached, batched))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--prefill-len", type=int, default=1000)
    ap.add_argument("--port", type=int, default=8124)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp())
    rows = {}
    for name, flags in MODES.items():
        proc, _ = start([sys.executable, "-m", "tidal.cli", "serve", "--port", str(args.port),
                         *flags], args.port, work / "serve.log")
        try:
            bench(args.port, "tidal", 8, 8, work / "warm.json", 1000)  # warmed up alike
            row = {}
            for c in args.concurrency:
                r = bench(args.port, "tidal", c, args.prompts if c > 1 else 8,
                          work / f"c{c}.json", c)
                row[c] = (r["output_throughput"], r["median_tpot_ms"])
            r = bench(args.port, "tidal", 1, 3, work / "prefill.json", 2000, args.prefill_len, 1)
            row["prefill"] = r["median_ttft_ms"] / 1e3
            row["agree"] = agreement(args.port)
        finally:
            stop(proc)
        rows[name] = row
        print(name, row, flush=True)
    base = rows["default"]
    heads = " | ".join(f"{c} at a time: tok/s (TPOT ms)" for c in args.concurrency)
    print(f"\n| mode | {heads} | {args.prefill_len}-token prefill | same bits "
          f"(of {len(QUESTIONS)}) |")
    print("|---|" + "---|" * (len(args.concurrency) + 2))
    for name, row in rows.items():
        cells = " | ".join(f"{row[c][0]:.1f} ({row[c][1]:.1f}), {row[c][0] / base[c][0]:.2f}x"
                           for c in args.concurrency)
        print(f"| {name} | {cells} | {row['prefill']:.2f} s, "
              f"{row['prefill'] / base['prefill']:.2f}x | {row['agree']} |")


if __name__ == "__main__":
    main()
