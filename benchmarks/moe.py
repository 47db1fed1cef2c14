"""Decode speed of a mixture-of-experts model against a dense one of the same active
parameters, offline on CPU: a Mixtral-shaped model (8 experts of width I, top 2) and a
Mistral-shaped one (one MLP of width 2 I), equal in everything else, with dummy weights
(a near-uniform router: every expert busy, as in a served batch).

Prints decode tokens/s of each at each batch size and the MoE/dense time ratio; all run
the PyTorch layers with the C++ paged attention kernel (the C++ whole-step decoder runs no
experts, so the dense models do without it too). A third, dense model as wide as all
experts together (E I) reads what the MoE reads once every expert is busy: the MoE's
distance from it is the cost of routing and grouping, its distance from the first is the
cost of reading E / k times the feed-forward weights.

usage: .venv/bin/python benchmarks/moe.py [--batch 1 32] [--hidden 512] [--layers 4]
                                          [--experts 8] [--top-k 2] [--expert-width 512]
                                          [--dtype auto]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from tidal import LLM, SamplingParams
from tidal.bench.word_tokenizer import save_word_tokenizer


def save_model(folder: Path, family: str, vocab: int, **shape) -> Path:
    """config.json and a word-level tokenizer: what `--load-format dummy` needs."""
    from transformers import AutoConfig

    AutoConfig.for_model(family, vocab_size=vocab, **shape).save_pretrained(str(folder))
    save_word_tokenizer(folder, vocab)
    return folder


def decode_rate(folder: Path, batch: int, tokens: int, repeats: int, dtype: str) -> float:
    """Best of `repeats` output tokens/s of `batch` 8-token prompts generating `tokens`."""
    llm = LLM(str(folder), dtype=dtype, load_format="dummy",
              num_kv_blocks=batch * (tokens + 16) // 16 + 8, max_num_seqs=batch, seed=0)
    llm.engine.runner.decoder = None  # the same PyTorch layers for every model
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    prompts = [{"prompt_token_ids": [3 + (i * 7 + j) % 200 for j in range(8)]}
               for i in range(batch)]
    llm.generate(prompts[:2], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    best = 0.0
    for _ in range(repeats):
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - t0
        best = max(best, sum(len(o.outputs[0].token_ids) for o in outs) / elapsed)
    return best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--expert-width", type=int, default=512)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dtype", default="auto", help="auto: the runner's choice for this CPU")
    args = p.parse_args()
    # no sliding window for any of them (Mistral's config has one by default, Mixtral's not)
    shape = dict(hidden_size=args.hidden, num_hidden_layers=args.layers, num_attention_heads=8,
                 num_key_value_heads=4, head_dim=args.hidden // 8, max_position_embeddings=4096,
                 sliding_window=None)
    root = Path(tempfile.mkdtemp())
    moe = save_model(root / "moe", "mixtral", 256, intermediate_size=args.expert_width,
                     num_local_experts=args.experts, num_experts_per_tok=args.top_k, **shape)
    dense = save_model(root / "dense", "mistral", 256,
                       intermediate_size=args.expert_width * args.top_k, **shape)
    wide = save_model(root / "wide", "mistral", 256,
                      intermediate_size=args.expert_width * args.experts, **shape)
    print(f"MoE: {args.experts} experts x {args.expert_width} wide, top {args.top_k}; dense: "
          f"{args.expert_width * args.top_k} wide; hidden {args.hidden}, {args.layers} layers, "
          f"dtype {args.dtype}, decode tokens/s (best of {args.repeats})")
    print("| batch | MoE | dense, active size | MoE / dense time | dense, all experts' size "
          "| MoE / that time |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: |")
    for batch in args.batch:
        moe_rate, dense_rate, wide_rate = (decode_rate(m, batch, args.tokens, args.repeats,
                                                       args.dtype)
                                           for m in (moe, dense, wide))
        print(f"| {batch} | {moe_rate:.0f} | {dense_rate:.0f} | {dense_rate / moe_rate:.2f}x | "
              f"{wide_rate:.0f} | {wide_rate / moe_rate:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
