"""`tidal calibrate`: time the real model runner over a grid of step shapes and fit the
cost model's efficiency factors and overheads to it, writing a hardware profile (JSON) that
`tidal simulate --hardware FILE` reads."""

from __future__ import annotations

import itertools
import json
import logging
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from tidal.bench.arrivals import arrival_times
from tidal.bench.dataset import BenchRequest, DatasetSpec, load_dataset
from tidal.bench.metrics import summarize
from tidal.core.step_time import ERROR_QUANTILES, STEP_TIME_TERMS
from tidal.engine.step_profile import measure
from tidal.sim.cost_model import CostModel, StepShape
from tidal.sim.profiles import Hardware, weight_params

log = logging.getLogger("tidal.calibrate")

DECODE_CONTEXTS = (64, 256, 512)  # cached tokens behind each timed decode


def default_grid(max_batch: int = 64, max_prefill: int = 1024) -> list[list[tuple[int, int]]]:
    """Step shapes as (new tokens, cached tokens) per sequence: decodes at batch sizes 1, 2,
    4 .. max_batch and three contexts; single prefills of 16 .. max_prefill tokens, one after
    a cached prefix; prefills mixed with up to max_batch decodes."""
    batches = [1 << i for i in range(max_batch.bit_length()) if 1 << i <= max_batch]
    grid = [[(1, c)] * b for b, c in itertools.product(batches, DECODE_CONTEXTS)]
    prefills = [n for n in (16, 64, 128, 256, 512, 1024, 2048, 4096, 8192) if n <= max_prefill]
    grid += [[(n, 0)] for n in prefills] + [[(256, 512)]]
    grid += [[(256, 0)] + [(1, 256)] * b for b in (4, 16, 32) if b <= max_batch]
    return grid


def _fit_overheads(rows: np.ndarray, residual: np.ndarray, weight: np.ndarray):
    """Non-negative least squares for the overheads (one per column of `rows`): every subset
    of active terms, keeping the best fit whose coefficients are all >= 0."""
    k = rows.shape[1]
    best = (np.inf, np.zeros(k))
    for mask in itertools.product((0, 1), repeat=k):
        cols = [i for i in range(k) if mask[i]]
        coef = np.zeros(k)
        if cols:
            sol, *_ = np.linalg.lstsq(rows[:, cols] * weight[:, None], residual * weight,
                                      rcond=None)
            if (sol < 0).any():
                continue
            coef[cols] = sol
        err = float((((rows @ coef) - residual) * weight) ** 2 @ np.ones(len(residual)))
        if err < best[0]:
            best = (err, coef)
    return best


def fit(cost: CostModel, timings: list[tuple[StepShape, float]]) -> tuple[Hardware, float]:
    """The efficiencies (grid search) and overheads (least squares) that minimise the
    squared relative error of predicted step times; returns the profile and its mean
    absolute relative error."""
    hw = cost.hw
    hw.request_latency = 0.0  # the runner alone; calibrate_serving adds serving's costs
    shapes = [s for s, _ in timings]
    measured = np.array([t for _, t in timings])
    weight = 1 / measured
    rows = np.array([[1.0, s.seqs, s.tokens, s.gathered] for s in shapes])
    # Above 1: the nominal peak undersells this machine (e.g. AMX bf16 on an Intel CPU).
    grid = np.geomspace(0.02, 16.0, 21)
    best = (np.inf, None)
    for c_eff, a_eff, bw_eff in itertools.product(grid, grid, grid):
        hw.compute_efficiency, hw.attention_efficiency, hw.bandwidth_efficiency = \
            c_eff, a_eff, bw_eff
        roof = np.array([cost.roofline(s) for s in shapes])
        err, coef = _fit_overheads(rows, measured - roof, weight)
        if err < best[0]:
            best = (err, (c_eff, a_eff, bw_eff, coef))
    c_eff, a_eff, bw_eff, coef = best[1]
    hw.compute_efficiency, hw.attention_efficiency, hw.bandwidth_efficiency = \
        float(c_eff), float(a_eff), float(bw_eff)
    (hw.step_overhead, hw.seq_overhead, hw.token_overhead,
     hw.context_overhead) = (float(x) for x in coef)
    predicted = np.array([cost.shape_time(s) for s in shapes])
    return hw, float(np.mean(np.abs(predicted - measured) / measured))


def calibrate(model: str, hardware: Hardware, engine_kwargs: dict, repeats: int = 5,
              grid: list[list[tuple[int, int]]] | None = None):
    """Build the real worker for `model`, time it, fit `hardware`'s factors. Returns
    (profile, mean error, [(shape, measured, predicted)])."""
    import torch

    from tidal.engine.config import EngineConfig
    from tidal.engine.worker import Worker
    from tidal.model.config import ModelArch
    from tidal.model.registry import resolve_model
    from tidal.sim.profiles import MODEL_CONFIGS

    config = EngineConfig.from_kwargs(**engine_kwargs, model=model)
    with tempfile.TemporaryDirectory() as tmp:
        if model in MODEL_CONFIGS and config.model.load_format == "dummy":
            folder = Path(tmp)
            (folder / "config.json").write_text(json.dumps(MODEL_CONFIGS[model]))
        else:
            folder = resolve_model(model)[0]
        worker = Worker(folder, config.model, config.cache.block_size)
        arch = ModelArch.from_folder(folder)
    timings = measure(worker, grid or default_grid(), repeats, arch.vocab_size)
    hardware.dtype_bytes = worker.dtype.itemsize
    quantized = getattr(worker.model, "gguf", None)  # weights served in the file's formats
    hardware.weight_bytes = quantized.nbytes / weight_params(arch) if quantized else 0.0
    cost = CostModel(arch, hardware)
    profile, error = fit(cost, timings)
    threads = f", threads={torch.get_num_threads()}" if worker.device == "cpu" else ""
    profile.calibrated_on = (f"{model} on {worker.device} ({str(worker.dtype).split('.')[-1]}"
                             f"{threads}), {len(timings)} step shapes, mean error {error:.1%}")
    rows = [(s, t, cost.shape_time(s)) for s, t in timings]
    return profile, error, rows


# Few requests at a time, so the difference is serving's own cost, not queueing.
SERVING_WORKLOAD = dict(name="random", input_len=128, output_len=24, num_prompts=12)


def serving_workload(seed: int, vocab_size: int, max_model_len: int,
                     ) -> tuple[list[BenchRequest], list[float]]:
    """SERVING_WORKLOAD's requests (other prompts for each seed) and their send times: all
    at once, as `--request-rate` unset sends a dataset without timestamps."""
    requests = load_dataset(DatasetSpec(**SERVING_WORKLOAD, seed=seed, vocab_size=vocab_size,
                                        max_model_len=max_model_len))
    return requests, arrival_times(requests, None, seed=seed)


def _samples(base_url: str, *names: str) -> list[list]:
    """The samples of each metric family of `names` on a tidal server's /metrics."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(base_url + "/metrics", timeout=10).text
    found = {f.name: f.samples for f in text_string_to_metric_families(text) if f.samples}
    missing = [n for n in names if n not in found]
    if missing:
        raise RuntimeError(f"{base_url} does not report {', '.join(missing)}: not a tidal "
                           "server, or one without a step-time model?")
    return [found[n] for n in names]


def served_counters(base_url: str) -> np.ndarray:
    """The server's runner seconds, step seconds and steps so far, once its cores' stats
    are fresh (`tidal:model_execute_seconds`, `engine_step_seconds`, `num_steps`)."""
    time.sleep(0.7)  # cores report every 0.5 s
    names = ("tidal:model_execute_seconds", "tidal:engine_step_seconds", "tidal:num_steps")
    return np.array([sum(s.value for s in samples)
                     for samples in _samples(base_url, *names)])


def step_target_ms(base_url: str) -> float:
    """The step target a tidal server sizes its steps to (`tidal:max_step_seconds`), ms."""
    return _samples(base_url, "tidal:max_step_seconds")[0][0].value * 1000


def learned_profile(profile: Hardware, base_url: str) -> Hardware:
    """`profile` timing steps as the tidal server at `base_url` plans them: its learned
    step-time model (`tidal:step_time_coefficient`, fitted to its recent steps, so serve it
    a workload like the one to simulate first), how its steps scattered around that model's
    predictions (`tidal:step_time_prediction_ratio`), its step target, and what its steps
    cost besides the runner (scheduling, outputs) on average since it started."""
    coefficients, ratios = _samples(base_url, "tidal:step_time_coefficient",
                                    "tidal:step_time_prediction_ratio")
    by_term = {s.labels["term"]: s.value for s in coefficients}
    profile.step_time = [by_term.get(t, 0.0) for t in STEP_TIME_TERMS]
    by_quantile = {float(s.labels["quantile"]): s.value for s in ratios}
    if all(by_quantile.get(q, 0.0) > 0 for q in ERROR_QUANTILES):
        # measured / predicted at quantile q is 1 / (predicted / measured at 1 - q)
        profile.step_scatter = [1 / by_quantile[q] for q in reversed(ERROR_QUANTILES)]
    profile.max_step_ms = step_target_ms(base_url)
    execute, step, steps = served_counters(base_url)
    profile.step_overhead = max(0.0, step - execute) / max(1.0, steps)
    profile.calibrated_on = (f"the learned step-time model of the server at {base_url}: "
                             + ", ".join(f"{t} {c:.3g} s"
                                         for t, c in zip(STEP_TIME_TERMS, profile.step_time))
                             + f"; {profile.step_overhead * 1e3:.2f} ms a step besides")
    return profile


def calibrate_serving(profile: Hardware, model: str, base_url: str) -> Hardware:
    """What serving adds to the runner, from a tidal server of the same model and engine
    flags at `base_url`: it serves SERVING_WORKLOAD one request at a time and four at a
    time while its own counters time the steps. The runner's seconds there over the
    simulator's for the same workloads scale every runner term of `profile` (a server's
    runner may run slower beside its frontend than alone); the rest of each step (update,
    sending outputs) adds to `step_overhead`; then the median TTFT gap one at a time
    (HTTP, tokenization, IPC) becomes `request_latency`. The server's step target becomes
    the profile's `max_step_ms`, so that simulated steps are sized as served ones."""
    from tidal.bench.client import Target
    from tidal.bench.flags import DEFAULT_MAX_MODEL_LEN
    from tidal.bench.serve import DEFAULT_TOKENIZER, bench_serve
    from tidal.model.registry import resolve_model
    from tidal.model.tokenizer import Tokenizer

    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per scrape
    profile.max_step_ms = step_target_ms(base_url)  # simulated steps sized as served ones
    tokenizer = Tokenizer(resolve_model(DEFAULT_TOKENIZER)[0])  # as `tidal bench serve`
    profile.request_latency = 0.0
    served, simulated, reals = np.zeros(3), 0.0, []
    # (seed, concurrency): other prompts each run, as the server's prefix cache would serve
    # repeated ones.
    runs = [(10 + c, c) for c in (1, 4)]
    for seed, c in runs:
        requests, times = serving_workload(seed, tokenizer.vocab_size, DEFAULT_MAX_MODEL_LEN)
        before = served_counters(base_url)
        summary, results = bench_serve(Target(base_url=base_url, ignore_eos=True), tokenizer,
                                       requests, times, max_concurrency=c)
        failed = [r.error for r in results if r.error]
        if failed:
            log.warning("%d of %d requests to %s failed; the first: %s", len(failed),
                        len(results), base_url, failed[0])
        reals.append(summary)
        served += served_counters(base_url) - before
        simulated += _simulate(profile, model, seed, c)[0]
    execute, step, steps = served
    ratio = execute / simulated
    for f in ("compute_efficiency", "attention_efficiency", "bandwidth_efficiency"):
        setattr(profile, f, getattr(profile, f) / ratio)
    for f in ("step_overhead", "seq_overhead", "token_overhead", "context_overhead"):
        setattr(profile, f, getattr(profile, f) * ratio)
    profile.step_overhead += max(0.0, step - execute) / steps
    gap = reals[0]["median_ttft_ms"] - _simulate(profile, model, *runs[0])[1]
    profile.request_latency = max(0.0, gap / 1e3)
    profile.calibrated_on += (f"; serving at {base_url}: runner {ratio:.2f}x the fit's, "
                              f"{(step - execute) / steps * 1e3:.2f} ms a step besides, "
                              f"request latency {profile.request_latency * 1e3:.1f} ms")
    return profile


def _simulate(profile: Hardware, model: str, seed: int, concurrency: int,
              ) -> tuple[float, float]:
    """Simulate SERVING_WORKLOAD (`seed`, `concurrency` at a time) on `model` with
    `profile`, as `tidal simulate` would: the replica's busy seconds and the median TTFT
    in ms."""
    from tidal.sim.build import build_simulator

    sim, arch, _, config = build_simulator(model, replace(profile))
    requests, times = serving_workload(seed, arch.vocab_size, config.scheduler.max_model_len)
    run = sim.run(requests, times, concurrency)
    return run.busy_seconds, summarize(run.results, run.duration)["median_ttft_ms"]


def format_rows(rows) -> str:
    lines = [f"{'seqs':>5} {'tokens':>7} {'ctx pairs':>10} {'measured ms':>12} {'model ms':>9}"]
    for s, t, p in rows:
        lines.append(f"{s.seqs:>5} {s.tokens:>7} {s.pairs:>10} {t * 1e3:>12.2f} {p * 1e3:>9.2f}")
    return "\n".join(lines)

