"""Predicted outputs (OpenAI's chat `prediction`) on a `tidal serve --speculative-method
ngram`: the time of an answer with no prediction, with its own text as the prediction (the
most a prediction can give: an edit that changes nothing), and with the answer to a
neighbouring question (a prediction that is mostly wrong), one request at a time, greedy.
Each question is asked twice first, so that every timed request finds its prompt in the
prefix cache alike; the answers are checked to be the same in every mode.

usage: .venv/bin/python benchmarks/predicted_outputs.py [--repeats 3] [--max-tokens 200]
       [--port 8123]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from statistics import median

import openai

sys.path.insert(0, str(Path(__file__).resolve().parent))
from quantized import start, stop  # noqa: E402  (the same start-and-wait-for-ready)

QUESTIONS = ["Explain in one paragraph how a hash map works.",
             "Write a short story about a robot learning to paint.",
             "List ten tips for writing clean Python code."]
NEIGHBOUR = " Be brief."  # appended: the neighbouring question


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=200)
    ap.add_argument("--port", type=int, default=8123)
    args = ap.parse_args()
    log = Path(tempfile.mkdtemp()) / "serve.log"
    proc, _ = start([sys.executable, "-m", "tidal.cli", "serve", "--port", str(args.port),
                     "--speculative-method", "ngram"], args.port, log)
    try:
        chat = openai.OpenAI(base_url=f"http://127.0.0.1:{args.port}/v1", api_key="x",
                             max_retries=0).chat

        def ask(question: str, prediction: str | None = None) -> tuple[float, int, str]:
            extra = {} if prediction is None else {
                "prediction": {"type": "content", "content": prediction}}
            t0 = time.perf_counter()
            out = chat.completions.create(
                model="smollm2-135m", max_tokens=args.max_tokens, temperature=0,
                messages=[{"role": "user", "content": question}], **extra)
            return time.perf_counter() - t0, out.usage.completion_tokens, \
                out.choices[0].message.content

        print(f"{'question':34s} {'tokens':>6s} {'none s':>7s} {'own s':>7s} {'ratio':>6s} "
              f"{'neighbour s':>11s} {'ratio':>6s}")
        for q in QUESTIONS:
            for _ in range(2):  # both prompts' blocks in the prefix cache
                own, other = ask(q)[2], ask(q + NEIGHBOUR)[2]
            runs: dict[str, list] = {"none": [], "own": [], "neighbour": []}
            for _ in range(args.repeats):  # the modes alternated
                runs["none"].append(ask(q))
                runs["own"].append(ask(q, own))
                runs["neighbour"].append(ask(q, other))
            if any(r[2] != own for rs in runs.values() for r in rs):
                raise SystemExit(f"a prediction changed the answer to {q!r}")
            t = {mode: median(r[0] for r in rs) for mode, rs in runs.items()}
            print(f"{q[:34]:34s} {runs['none'][0][1]:6d} {t['none']:7.3f} {t['own']:7.3f} "
                  f"{t['none'] / t['own']:5.2f}x {t['neighbour']:11.3f} "
                  f"{t['none'] / t['neighbour']:5.2f}x")
    finally:
        stop(proc)


if __name__ == "__main__":
    main()
