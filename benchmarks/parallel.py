"""Tensor and pipeline parallelism on this machine: one process with every core against N
ranks sharing them (TP ranks in each of PP stages), offline, on a Llama-shaped model with
random weights (`--load-format dummy`; the speed of a step does not depend on the values),
greedy, ignore_eos. Prints output tok/s
one request at a time and C at once, and the ratio N ranks / one process.

    python benchmarks/parallel.py [--tp 2] [--pp 1] [--concurrency 1 8] [--max-tokens 32]
        [--hidden 1024] [--layers 16] [--dtype float32] [--q4km] [--memory] [--kv-blocks 512]

`--q4km`: the same shape as a GGUF file in Q4_K_M's formats (q/k/o/gate/up Q4_K, v/down
and the tied embedding Q6_K; random valid blocks), run in its own formats; `--hidden 2048
--layers 16 --q4km` is a Llama-3.2-1B shape (with the embedded model's 49k vocabulary).

The split runs with the engine's default threads: a rank's share of the cores its stage
computes with (pipeline stages on one machine take turns, each rank with a short OpenMP
spin). The targets: N = 2 ranks of one thread each >= 0.9x one process of two threads
(the all-reduces, two a layer, must cost under 10%); two pipeline stages >= 0.9x at 8
concurrent.

`--memory`: each process's PSS (/proc/PID/smaps_rollup: pages shared between processes,
such as torch's libraries, counted in shares) after the timed runs' short requests, and
again after prompts that write the whole KV pool (`--kv-blocks` blocks of 16 tokens, each
rank its share of every block), against one process's; the target: each rank <= 0.6x of
one process. Each layout runs in a fresh process.
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


def q4km_file(tmp: Path, hidden: int, layers: int) -> Path:
    """A GGUF of the Llama shape model_folder writes, in Q4_K_M's formats, with the
    embedded model's tokenizer."""
    import gguf
    import numpy as np
    from gguf import GGMLQuantizationType as QT

    from gguf_kernels import random_blocks
    from tidal.model.gguf_file import open_gguf
    from tidal.model.registry import embedded_gguf

    source = open_gguf(embedded_gguf("smollm2-135m"))
    heads, inter, rng = hidden // 64, 4 * hidden, np.random.default_rng(0)
    path = tmp / f"llama-{hidden}x{layers}-q4km.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(layers)
    w.add_context_length(4096)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(inter)
    w.add_head_count(heads)
    w.add_head_count_kv(heads // 4)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(500000.0)
    w.add_rope_dimension_count(64)
    for key, field in source.fields.items():  # the tokenizer, as the embedded file has it
        if key.startswith("tokenizer."):
            value = field.contents()
            w.add_key_value(key, value, field.types[0],
                            field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY
                            else None)
    vocab = len(source.fields["tokenizer.ggml.tokens"].contents())

    def matrix(name: str, qtype: QT, rows: int, cols: int) -> None:
        w.add_tensor(name, random_blocks(qtype, rows, cols, rng), raw_dtype=qtype)

    matrix("token_embd.weight", QT.Q6_K, vocab, hidden)
    w.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    kv = hidden // 4
    for i in range(layers):
        for name, qtype, rows, cols in (("attn_q", QT.Q4_K, hidden, hidden),
                                        ("attn_k", QT.Q4_K, kv, hidden),
                                        ("attn_v", QT.Q6_K, kv, hidden),
                                        ("attn_output", QT.Q4_K, hidden, hidden),
                                        ("ffn_gate", QT.Q4_K, inter, hidden),
                                        ("ffn_up", QT.Q4_K, inter, hidden),
                                        ("ffn_down", QT.Q6_K, hidden, inter)):
            matrix(f"blk.{i}.{name}.weight", qtype, rows, cols)
        for norm in ("attn_norm", "ffn_norm"):
            w.add_tensor(f"blk.{i}.{norm}.weight", np.ones(hidden, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def pss_mib() -> list[float]:
    """PSS in MiB of this process (rank 0) and then of each rank it started."""
    import psutil

    me = psutil.Process()
    ranks = [p for p in me.children(recursive=True)
             if "tidal.engine.tp_executor" in " ".join(p.cmdline())]
    return [p.memory_full_info().pss / 2**20 for p in [me, *ranks]]


def fresh(fn, *args):
    """fn(*args) in a new process: rank 0's memory then holds one layout's alone (and its
    LLM sets its OpenMP spin before torch loads)."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(fn, *args).result()


def throughput(model: Path, tp: int, pp: int, threads: int | None, concurrency: list[int],
               max_tokens: int, dtype: str, memory: bool = False,
               kv_blocks: int = 512) -> tuple[dict, dict]:
    """Output tok/s at each concurrency; with `memory`, also each process's PSS after
    those runs ("short") and after prompts that fill the pool ("full")."""
    from tidal import LLM, SamplingParams

    options = ({} if model.suffix == ".gguf"  # its own formats, in float32 (--dtype auto)
               else dict(dtype=dtype, load_format="dummy"))
    llm = LLM(str(model), tensor_parallel_size=tp, pipeline_parallel_size=pp,
              num_threads=threads, num_kv_blocks=kv_blocks, max_model_len=1024, **options)
    rng = random.Random(0)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    try:
        warm = [{"prompt_token_ids": [rng.randrange(100, 40000) for _ in range(64)]}]
        llm.generate(warm, params, use_tqdm=False)
        out, mem = {}, {}
        for c in concurrency:
            prompts = [{"prompt_token_ids": [rng.randrange(100, 40000) for _ in range(64)]}
                       for _ in range(c)]
            t0 = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            out[c] = c * max_tokens / (time.perf_counter() - t0)
        if memory:
            mem["short"] = pss_mib()
            # prompts of 1,000 tokens: every block written, as a busy server's are
            fill = [{"prompt_token_ids": [rng.randrange(100, 40000) for _ in range(1000)]}
                    for _ in range(max(1, kv_blocks * 16 // 1000))]
            llm.generate(fill, SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)
            mem["full"] = pss_mib()
        return out, mem
    finally:
        llm.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--pp", type=int, default=1, help="pipeline stages (of --tp ranks each)")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--q4km", action="store_true", help="a GGUF in Q4_K_M's formats")
    ap.add_argument("--memory", action="store_true", help="each process's PSS, after short "
                    "requests and with the KV pool filled")
    ap.add_argument("--kv-blocks", type=int, default=512, help="the KV pool's blocks")
    args = ap.parse_args()
    cores = len(os.sched_getaffinity(0))
    with tempfile.TemporaryDirectory() as tmp:
        os.environ.setdefault("TIDAL_CACHE", str(Path(tmp) / "cache"))
        model = (q4km_file(Path(tmp), args.hidden, args.layers) if args.q4km
                 else model_folder(Path(tmp), args.hidden, args.layers))
        ranks = args.tp * args.pp
        one, mem_one = fresh(throughput, model, 1, 1, cores, args.concurrency,
                             args.max_tokens, args.dtype, args.memory, args.kv_blocks)
        split, mem_split = fresh(throughput, model, args.tp, args.pp, None,  # the defaults
                                 args.concurrency, args.max_tokens, args.dtype, args.memory,
                                 args.kv_blocks)
    kind = "Q4_K_M formats" if args.q4km else args.dtype
    print(f"\nLlama shape hidden {args.hidden} x {args.layers} layers, {kind}, "
          f"{cores} cores; output tok/s ({args.max_tokens} tokens a request)")
    busy = args.tp if args.pp > 1 else ranks  # stages on one machine take turns
    print(f"| concurrent | 1 process, {cores} threads | TP={args.tp} x PP={args.pp}, "
          f"{max(1, cores // busy)} thread(s) each | split / 1 |")
    print("|---|---|---|---|")
    for c in args.concurrency:
        print(f"| {c} | {one[c]:.1f} | {split[c]:.1f} | {split[c] / one[c]:.2f}x |")
    if args.memory:
        print(f"\nPSS, MiB (rank 0 runs the engine; {args.kv_blocks} KV blocks)\n"
              "| KV pool | 1 process | " + " | ".join(f"rank {r}" for r in range(ranks))
              + " | largest rank / 1 |\n|---|---|" + "---|" * ranks + "---|")
        for when, label in (("short", "after short requests"), ("full", "filled")):
            one_mib, mibs = mem_one[when][0], mem_split[when]
            print(f"| {label} | {one_mib:,.0f} | " + " | ".join(f"{m:,.0f}" for m in mibs)
                  + f" | {max(mibs) / one_mib:.2f}x |")


if __name__ == "__main__":
    main()
