"""What a JSON schema costs decoding: offline output tokens/s of the embedded model at batch
1 and 32, unconstrained and constrained to a JSON schema, with the same prompts, lengths
(ignore_eos off; max_tokens bounds both) and seeds. The constrained runs compute each step's
grammar masks on a worker thread while the forward pass runs.

usage: .venv/bin/python benchmarks/structured.py [--batch 1 32] [--max-tokens 64] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import time

from tidal import LLM, SamplingParams

SCHEMA = {"type": "object", "required": ["name", "age", "city", "tags"],
          "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                         "city": {"type": "string"},
                         "tags": {"type": "array", "items": {"type": "string"}}}}


def rate(llm: LLM, batch: int, params: SamplingParams, repeats: int) -> tuple[float, int]:
    """Best output tokens/s of `repeats` runs, and the tokens of the last."""
    prompts = [[{"role": "user", "content": f"Describe person number {i} as JSON."}]
               for i in range(batch)]
    best, tokens = 0.0, 0
    for _ in range(repeats):
        t0 = time.perf_counter()
        outs = llm.chat(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - t0
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        best = max(best, tokens / elapsed)
    return best, tokens


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    llm = LLM("smollm2-135m", seed=0)
    free = SamplingParams(max_tokens=args.max_tokens, temperature=1.0, seed=1,
                          ignore_eos=True)
    schema = SamplingParams(max_tokens=args.max_tokens, temperature=1.0, seed=1,
                            ignore_eos=True, structured=("json", json.dumps(SCHEMA)))
    rate(llm, 2, schema, 1)  # warm up: the grammar tokenizer is built on first use
    print("| batch | unconstrained tokens/s | JSON schema tokens/s | schema / free |")
    print("| ---: | ---: | ---: | ---: |")
    for batch in args.batch:
        (a, na), (b, nb) = rate(llm, batch, free, args.repeats), rate(llm, batch, schema,
                                                                       args.repeats)
        print(f"| {batch} | {a:.1f} ({na} tokens) | {b:.1f} ({nb} tokens) | {b / a:.2f} |",
              flush=True)


if __name__ == "__main__":
    main()
