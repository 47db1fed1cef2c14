"""GPU speed of the model runner with dummy weights (no download): decode step time by batch
and context, eager and with CUDA graphs; one long prefill's TFLOP/s; and offline output
tokens/s of a random 1024-in / 256-out workload at several concurrencies beside HF
transformers' continuous batching (`generate_batch`) in the same run.

usage: python benchmarks/gpu_decode.py [--models smollm2-135m llama-3-8b]
           [--batch 1 8 64 256] [--context 512 2048] [--prefill 8192]
           [--concurrency 1 16 64 256] [--no-hf] [--device cuda]

Shapes that do not fit the KV cache print "-". Runs on CPU too (--device cpu, small
sizes), which is how CI-less machines check the script itself.
"""

from __future__ import annotations

import argparse
import gc
import json
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from tidal.bench.word_tokenizer import save_word_tokenizer
from tidal.core import SchedulerConfig
from tidal.engine.config import ModelConfig
from tidal.engine.step_profile import measure
from tidal.engine.worker import Worker
from tidal.model.config import ModelArch
from tidal.sim.profiles import MODEL_CONFIGS, linear_params


def dummy_folder(root: Path, name: str) -> Path:
    """config.json of a built-in profile and a word-level tokenizer: all `--load-format
    dummy` needs."""
    folder = root / name
    folder.mkdir(parents=True, exist_ok=True)
    config = MODEL_CONFIGS[name]
    (folder / "config.json").write_text(json.dumps(config))
    save_word_tokenizer(folder, config["vocab_size"])
    return folder


def runner(folder: Path, device: str, eager: bool, max_seqs: int) -> Worker:
    config = ModelConfig(load_format="dummy", device=device, enforce_eager=eager)
    return Worker(folder, config, 16, SchedulerConfig(max_num_seqs=max_seqs))


def release() -> None:
    """Free the device memory of what the caller has just deleted."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def decode_table(folder: Path, args) -> None:
    print(f"decode step (ms), {folder.name}: eager / graphs")
    times = {}
    for eager in (True, False):
        r = runner(folder, args.device, eager, max(args.batch))
        for b in args.batch:
            for c in args.context:
                try:
                    (_, t), = measure(r, [[(1, c)] * b], repeats=args.repeats)
                except ValueError:  # more KV than the cache holds
                    t = None
                times[eager, b, c] = t
        del r
        release()
    for b in args.batch:
        cells = []
        for c in args.context:
            e, g = times[True, b, c], times[False, b, c]
            cells.append(f"ctx {c}: " + " / ".join("-" if t is None else f"{t * 1e3:.2f}"
                                                   for t in (e, g)))
        print(f"  batch {b:>4}  " + "   ".join(cells))


def prefill_rate(folder: Path, args) -> None:
    """One prefill's time and TFLOP/s, through the paged prefill kernel and through SDPA
    (the backend without the kernel), to choose between them."""
    arch = ModelArch.from_folder(folder)
    r = runner(folder, args.device, True, 1)
    n = args.prefill
    flops = 2 * linear_params(arch) * n + 2 * arch.num_layers * n * n * \
        arch.num_heads * arch.head_dim  # causal QK^T and PV: half of 4 n^2 H D each layer
    cells = []
    for name in ("kernel", "sdpa"):
        r.model.backend.fresh_kernel_scores = 0 if name == "kernel" else None
        if name == "sdpa" or r.model.backend.prefill_kernel is None:
            r.model.backend.prefill_kernel, name = None, "sdpa"
        (_, t), = measure(r, [[(n, 0)]], repeats=args.repeats)
        cells.append(f"{name} {t * 1e3:.1f} ms = {flops / t / 1e12:.0f} TFLOP/s")
    del r
    release()
    print(f"prefill {n} tokens, {folder.name}: " + "; ".join(cells))


def workload(vocab: int, count: int, length: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return rng.integers(10, vocab - 10, (count, length)).tolist()


def tidal_rate(folder: Path, prompts: list[list[int]], concurrency: int, device: str,
               out_len: int) -> float:
    from tidal import LLM, SamplingParams

    llm = LLM(str(folder), load_format="dummy", device=device, max_num_seqs=concurrency)
    params = SamplingParams(max_tokens=out_len, temperature=0, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in prompts[:concurrency]], params,
                 use_tqdm=False)  # warm-up
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    rate = sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t0)
    del llm
    release()
    return rate


def hf_rate(folder: Path, prompts: list[list[int]], concurrency: int, device: str,
            out_len: int) -> float:
    """transformers' continuous batching over the same prompts, `concurrency` at a time
    (fixed output lengths: every wave ends together, as a continuous batch would run)."""
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    config = AutoConfig.from_pretrained(str(folder))
    with torch.device(device):  # initialising 8B parameters on a CPU takes minutes
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16,
                                                 attn_implementation="sdpa")
    gen = GenerationConfig(max_new_tokens=out_len, do_sample=False, eos_token_id=-1,
                           pad_token_id=0)
    model.generate_batch(prompts[:concurrency], generation_config=gen, progress_bar=False)
    t0 = time.perf_counter()
    tokens = 0
    for i in range(0, len(prompts), concurrency):
        out = model.generate_batch(prompts[i:i + concurrency], generation_config=gen,
                                   progress_bar=False)
        tokens += sum(len(o.generated_tokens) for o in out.values())
    rate = tokens / (time.perf_counter() - t0)
    del model
    release()
    return rate


def throughput_table(folder: Path, args) -> None:
    vocab = MODEL_CONFIGS[folder.name]["vocab_size"]
    print(f"output tokens/s, {folder.name}, {args.input_len} in / {args.output_len} out, "
          f"{args.waves} waves per concurrency: tidal / HF continuous batching / ratio")
    for c in args.concurrency:
        prompts = workload(vocab, c * args.waves, args.input_len)
        ours = tidal_rate(folder, prompts, c, args.device, args.output_len)
        theirs = None
        if not args.no_hf:
            try:  # a peer that fails (its API moves between releases) still leaves tidal's row
                theirs = hf_rate(folder, prompts, c, args.device, args.output_len)
            except Exception as e:  # noqa: BLE001
                print(f"  transformers failed: {type(e).__name__}: {e}")
        cells = f"{ours:,.0f}" + ("" if theirs is None else
                                  f" / {theirs:,.0f} / {ours / theirs:.2f}x")
        print(f"  concurrency {c:>4}  {cells}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=["smollm2-135m", "llama-3-8b"],
                   choices=sorted(MODEL_CONFIGS))
    p.add_argument("--batch", nargs="+", type=int, default=[1, 8, 64, 256])
    p.add_argument("--context", nargs="+", type=int, default=[512, 2048])
    p.add_argument("--prefill", type=int, default=8192)
    p.add_argument("--concurrency", nargs="*", type=int, default=[1, 16, 64, 256],
                   help="none: no throughput table")
    p.add_argument("--waves", type=int, default=2, help="requests = waves x concurrency")
    p.add_argument("--input-len", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--no-hf", action="store_true", help="skip the transformers peer")
    p.add_argument("--device", default="cuda")
    args = p.parse_args()
    name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    print(f"device: {name}; torch {torch.__version__}")
    with tempfile.TemporaryDirectory() as tmp:
        for model in args.models:
            folder = dummy_folder(Path(tmp), model)
            decode_table(folder, args)
            prefill_rate(folder, args)
            if args.concurrency:
                throughput_table(folder, args)


if __name__ == "__main__":
    main()
