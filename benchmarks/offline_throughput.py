"""Offline throughput on the embedded model: tidal against HF transformers' continuous
batching (`generate_batch`) in the same run, plus tidal's decode step time by batch size.

    python benchmarks/offline_throughput.py [--model smollm2-135m] [--requests 64]
        [--max-tokens 64] [--skip-hf] [--batches 1 8 32 64]

Workload: N chat requests (the model's chat template around short questions), M output tokens
each, ignore_eos, temperature 0. Prints generated tokens/s for both and the ratio.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

QUESTIONS = [
    "What is the capital of France?", "Write a haiku about the sea.",
    "Explain photosynthesis in one sentence.", "List three uses of a paperclip.",
    "Why is the sky blue?", "Give me a recipe for pancakes.",
    "What is 17 times 23?", "Name four planets of the solar system.",
]


def chat_prompts(tokenizer, n: int) -> list[list[int]]:
    """The questions in the model's chat template (as plain text where it has none)."""
    out = []
    for i in range(n):
        question = f"{QUESTIONS[i % len(QUESTIONS)]} (#{i})"
        try:
            text = tokenizer.apply_chat_template([{"role": "user", "content": question}])
        except ValueError:  # no chat template
            text = question
        out.append(tokenizer.encode(text, add_special_tokens=False))
    return out


def bench_tidal(llm, prompts, max_tokens: int) -> float:
    from tidal import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in prompts[:2]], params, use_tqdm=False)  # warm
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    return sum(len(o.outputs[0].token_ids) for o in outs) / elapsed


def bench_hf(folder, prompts, max_tokens: int, dtype: torch.dtype) -> float:
    from transformers import AutoModelForCausalLM, ContinuousBatchingConfig, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype,
                                                 attn_implementation="sdpa").eval()
    gen = GenerationConfig(max_new_tokens=max_tokens, do_sample=False, eos_token_id=-1,
                           pad_token_id=0)
    cb = ContinuousBatchingConfig(num_blocks=2048, block_size=16)
    t0 = time.perf_counter()
    outs = model.generate_batch(prompts, generation_config=gen, continuous_batching_config=cb)
    elapsed = time.perf_counter() - t0
    return sum(len(o.generated_tokens) for o in outs.values()) / elapsed


def decode_step_ms(llm, batch: int, steps: int = 30, repeat: int = 5) -> float:
    """Wall time of a decode-only engine step with `batch` running requests: the median of
    `steps` steps, best of `repeat` runs (this VM's clock wanders by tens of percent)."""
    from tidal import SamplingParams

    engine = llm.engine
    params = SamplingParams(max_tokens=repeat * steps + 8, temperature=0, ignore_eos=True)
    prompt = engine.tokenize("The history of the printing press begins")
    rids = [engine.add_request(prompt, params) for _ in range(batch)]
    while engine.scheduler.stats().running_prefill or engine.scheduler.waiting:
        engine.step()
    best = float("inf")
    for _ in range(repeat):
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - t0)
        best = min(best, statistics.median(times))
    for rid in rids:
        engine.abort(rid)
    return best * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m",
                    help="a registry name, a Hugging Face folder or a .gguf file")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--quantization", default="auto",
                    help="auto (the GGUF in its own formats), gguf, none, int8 or int4")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--no-cpu-decoder", action="store_true",
                    help="decode with PyTorch ops instead of tidal's C++ CPU decoder")
    ap.add_argument("--fp32-gemm-rows", type=int, default=None,
                    help="engine knob fp32_gemm_rows (default: auto; 0: bf16 GEMMs only)")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64])
    args = ap.parse_args()

    from tidal import LLM

    llm = LLM(args.model, dtype=args.dtype, num_kv_blocks=2048,
              quantization=args.quantization, num_threads=args.threads,
              cpu_decoder=not args.no_cpu_decoder, fp32_gemm_rows=args.fp32_gemm_rows)
    dtype = llm.engine.executor.info.dtype
    prompts = chat_prompts(llm.tokenizer, args.requests)
    print(f"device {llm.engine.executor.info.device}, dtype {str(dtype).split('.')[-1]}, "
          f"quantization {args.quantization}, C++ decoder "
          f"{llm.engine.runner.decoder is not None}, torch threads "
          f"{torch.get_num_threads()}, {args.requests} requests x {args.max_tokens} tokens, "
          f"prompts {min(map(len, prompts))}-{max(map(len, prompts))} tokens")
    for b in args.batches:
        print(f"tidal decode step, batch {b:>3}: {decode_step_ms(llm, b):7.1f} ms")
    ours = bench_tidal(llm, prompts, args.max_tokens)
    print(f"tidal: {ours:8.1f} generated tokens/s")
    if not args.skip_hf:
        folder = llm.engine.runner_folder
        del llm
        theirs = bench_hf(folder, prompts, args.max_tokens, dtype)
        print(f"HF transformers generate_batch: {theirs:8.1f} generated tokens/s")
        print(f"ratio tidal / HF: {ours / theirs:.2f}x")


if __name__ == "__main__":
    main()
