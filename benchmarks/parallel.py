"""Tensor parallelism on this machine: one process with every core against N ranks sharing
them, offline, on a Llama-shaped model with random weights (`--load-format dummy`; the
speed of a step does not depend on the values), greedy, ignore_eos. Prints output tok/s
one request at a time and C at once, and the ratio N ranks / one process.

    python benchmarks/parallel.py [--tp 2] [--concurrency 1 8] [--max-tokens 32]
        [--hidden 1024] [--layers 16] [--dtype float32]

The target of the issue: N = 2 ranks of one thread each >= 0.9x one process of two threads
(the all-reduces, two a layer, must cost under 10%).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import tempfile
import time
from pathlib import Path


def model_folder(tmp: Path, hidden: int, layers: int) -> Path:
    """config.json of a Llama shape (64-dim heads, 4 query heads a KV head) and the embedded
    model's tokenizer (its vocabulary is the model's)."""
    from tidal.model.registry import resolve_model

    folder = tmp / f"llama-{hidden}x{layers}"
    folder.mkdir()
    heads = hidden // 64
    (folder / "config.json").write_text(json.dumps(dict(
        model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=hidden,
        intermediate_size=4 * hidden, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=heads // 4, head_dim=64, vocab_size=49152,
        max_position_embeddings=4096, rms_norm_eps=1e-5, tie_word_embeddings=True,
        bos_token_id=1, eos_token_id=2)))
    embedded, _ = resolve_model("smollm2-135m")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(embedded / name, folder / name)
    return folder


def throughput(folder: Path, tp: int, threads: int, concurrency: list[int], max_tokens: int,
               dtype: str) -> dict[int, float]:
    from tidal import LLM, SamplingParams

    llm = LLM(str(folder), tensor_parallel_size=tp, num_threads=threads, dtype=dtype,
              load_format="dummy", num_kv_blocks=512, max_model_len=1024)
    rng = random.Random(0)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    try:
        warm = [{"prompt_token_ids": [rng.randrange(100, 40000) for _ in range(64)]}]
        llm.generate(warm, params, use_tqdm=False)
        out = {}
        for c in concurrency:
            prompts = [{"prompt_token_ids": [rng.randrange(100, 40000) for _ in range(64)]}
                       for _ in range(c)]
            t0 = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            out[c] = c * max_tokens / (time.perf_counter() - t0)
        return out
    finally:
        llm.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args()
    cores = len(os.sched_getaffinity(0))
    with tempfile.TemporaryDirectory() as tmp:
        folder = model_folder(Path(tmp), args.hidden, args.layers)
        one = throughput(folder, 1, cores, args.concurrency, args.max_tokens, args.dtype)
        split = throughput(folder, args.tp, max(1, cores // args.tp), args.concurrency,
                           args.max_tokens, args.dtype)
    print(f"\nLlama shape hidden {args.hidden} x {args.layers} layers, {args.dtype}, "
          f"{cores} cores; output tok/s ({args.max_tokens} tokens a request)")
    print(f"| concurrent | 1 process, {cores} threads | TP={args.tp}, "
          f"{max(1, cores // args.tp)} thread(s) each | TP / 1 |")
    print("|---|---|---|---|")
    for c in args.concurrency:
        print(f"| {c} | {one[c]:.1f} | {split[c]:.1f} | {split[c] / one[c]:.2f}x |")


if __name__ == "__main__":
    main()
