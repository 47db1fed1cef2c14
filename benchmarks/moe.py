"""Decode speed of a mixture-of-experts model against a dense one of the same active
parameters, offline on CPU: a Mixtral-shaped model (8 experts of width I, top 2) and a
Mistral-shaped one (one MLP of width 2 I), equal in everything else, with dummy weights
(a near-uniform router: every expert busy, as in a served batch).

Prints decode tokens/s of each at each batch size and the dense/MoE time ratio; both run
the PyTorch layers (the C++ decoder runs no experts), and the dense model also through the
C++ decoder for reference.

usage: .venv/bin/python benchmarks/moe.py [--batch 1 32] [--hidden 512] [--layers 4]
                                          [--experts 8] [--top-k 2] [--expert-width 512]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from tidal import LLM, SamplingParams


def save_model(folder: Path, family: str, vocab: int, **shape) -> Path:
    """config.json and a word-level tokenizer: what `--load-format dummy` needs."""
    from tokenizers import Tokenizer, models
    from transformers import AutoConfig

    AutoConfig.for_model(family, vocab_size=vocab, **shape).save_pretrained(str(folder))
    tokenizer = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab)}, unk_token="w0"))
    tokenizer.save(str(folder / "tokenizer.json"))
    return folder


def decode_rate(folder: Path, batch: int, tokens: int, cpu_decoder: bool, repeats: int) -> float:
    """Best of `repeats` output tokens/s of `batch` 8-token prompts generating `tokens`."""
    llm = LLM(str(folder), dtype="bfloat16", load_format="dummy", cpu_decoder=cpu_decoder,
              num_kv_blocks=batch * (tokens + 16) // 16 + 8, max_num_seqs=batch, seed=0)
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
    llm.shutdown() if hasattr(llm, "shutdown") else None
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
    args = p.parse_args()
    shape = dict(hidden_size=args.hidden, num_hidden_layers=args.layers, num_attention_heads=8,
                 num_key_value_heads=4, head_dim=args.hidden // 8, max_position_embeddings=4096)
    root = Path(tempfile.mkdtemp())
    moe = save_model(root / "moe", "mixtral", 256, intermediate_size=args.expert_width,
                     num_local_experts=args.experts, num_experts_per_tok=args.top_k, **shape)
    dense = save_model(root / "dense", "mistral", 256,
                       intermediate_size=args.expert_width * args.top_k, **shape)
    print(f"MoE: {args.experts} experts x {args.expert_width} wide, top {args.top_k}; dense: "
          f"{args.expert_width * args.top_k} wide; hidden {args.hidden}, {args.layers} layers, "
          "bf16, decode tokens/s (best of {})".format(args.repeats))
    print("| batch | MoE | dense | MoE / dense time | dense, C++ decoder |")
    print("| ---: | ---: | ---: | ---: | ---: |")
    for batch in args.batch:
        rates = [decode_rate(moe, batch, args.tokens, False, args.repeats),
                 decode_rate(dense, batch, args.tokens, False, args.repeats),
                 decode_rate(dense, batch, args.tokens, True, args.repeats)]
        print(f"| {batch} | {rates[0]:.0f} | {rates[1]:.0f} | {rates[1] / rates[0]:.2f}x | "
              f"{rates[2]:.0f} |", flush=True)


if __name__ == "__main__":
    main()
