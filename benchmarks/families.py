"""Decode speed of a family's real shape with random weights (`--load-format dummy`): the C++
decoder against the PyTorch path in one run, and against Llama's layers of the same shape
(what the family's own parts cost).

    python benchmarks/families.py [--family smollm3 granite] [--batches 1 8]
        [--max-tokens 32] [--dtype bfloat16] [--threads 2] [--runs 3]
    python benchmarks/families.py --write DIR   # the folders alone, to serve:
    tidal serve --model DIR/smollm3 --load-format dummy --dtype bfloat16  (and DIR/smollm3-llama)

Shapes: SmolLM3-3B (36 layers, every fourth without RoPE) and Granite 3.x 2B (40 layers,
its four multipliers). Prints output tokens/s per batch size (the median of --runs runs
after one to warm up, fresh prompts each): the family on the C++ decoder, on the PyTorch
ops, and the same shape as `llama` on the C++ decoder.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from tidal.bench.word_tokenizer import save_word_tokenizer

SHAPES = {
    "smollm3": dict(model_type="smollm3", hidden_size=2048, intermediate_size=11008,
                    num_hidden_layers=36, num_attention_heads=16, num_key_value_heads=4,
                    vocab_size=128256, no_rope_layer_interval=4, tie_word_embeddings=True),
    "granite": dict(model_type="granite", hidden_size=2048, intermediate_size=8192,
                    num_hidden_layers=40, num_attention_heads=32, num_key_value_heads=8,
                    vocab_size=49155, embedding_multiplier=12.0, residual_multiplier=0.22,
                    attention_multiplier=0.015625, logits_scaling=8.0,
                    tie_word_embeddings=True),
}


def folder_of(config: dict, root: Path, name: str) -> Path:
    folder = root / name
    folder.mkdir()
    full = {"max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
            "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu", **config}
    (folder / "config.json").write_text(json.dumps(full))
    save_word_tokenizer(folder, config["vocab_size"])
    return folder


def tokens_per_s(folder: Path, batch: int, max_tokens: int, args, cpu_decoder: bool) -> float:
    from tidal import LLM, SamplingParams

    llm = LLM(str(folder), load_format="dummy", dtype=args.dtype, num_threads=args.threads,
              num_kv_blocks=64 * batch, cpu_decoder=cpu_decoder)
    try:
        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        rates = []
        for run in range(args.runs + 1):  # the first warms up; each run's prompts are fresh
            prompts = [{"prompt_token_ids": [3 + (run * 131 + i * 7 + j) % 500
                                             for j in range(32)]} for i in range(batch)]
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            rates.append(sum(len(o.outputs[0].token_ids) for o in outs)
                         / (time.perf_counter() - t0))
        return statistics.median(rates[1:])
    finally:
        llm.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--family", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--runs", type=int, default=3, help="timed runs a cell (median)")
    ap.add_argument("--write", type=Path, help="write each family's folder and its llama "
                    "twin here (config.json, a word-level tokenizer) and stop")
    args = ap.parse_args()
    if args.write:
        args.write.mkdir(parents=True, exist_ok=True)
        for name in args.family:
            folder_of(SHAPES[name], args.write, name)
            folder_of({**SHAPES[name], "model_type": "llama"}, args.write, name + "-llama")
        return
    print("| family | batch | C++ decoder tok/s | PyTorch ops tok/s | as llama tok/s |")
    print("|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.family:
            own = folder_of(SHAPES[name], Path(tmp), name)
            llama = folder_of({**SHAPES[name], "model_type": "llama"}, Path(tmp), name + "-llama")
            for batch in args.batches:
                row = [tokens_per_s(own, batch, args.max_tokens, args, True),
                       tokens_per_s(own, batch, args.max_tokens, args, False),
                       tokens_per_s(llama, batch, args.max_tokens, args, True)]
                print(f"| {name} | {batch} | " + " | ".join(f"{v:.1f}" for v in row) + " |",
                      flush=True)


if __name__ == "__main__":
    main()
