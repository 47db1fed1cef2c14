"""The step-time profile of a model on this machine: step times measured at start-up over a
small grid of shapes (or read back from the profile saved by an earlier start), which seed
the engine's step-time model so that it is right from the first step. `tidal calibrate`
times a worker with the same `measure`."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import random
import statistics
import time
from pathlib import Path
from typing import TYPE_CHECKING

from tidal.core import NewRequest, SamplingParams, ScheduledRequest, SchedulerOutput, StepShape
from tidal.core.kv_cache_manager import cdiv
from tidal.model.registry import cache_root

if TYPE_CHECKING:
    from tidal.engine.worker import WorkerInfo

log = logging.getLogger("tidal.engine")

PROFILE_VERSION = 3  # bump when the grid or the runner's timing changes meaning
DECODE_CONTEXT = 256  # cached tokens behind each timed decode row
REPEAT_SECONDS = 0.15  # a shape is timed up to 3 times while its runs take less in all


def startup_grid(max_tokens: int = 1024, max_len: int = 1 << 30,
                 ) -> list[list[tuple[int, int]]]:
    """Step shapes as (new tokens, cached tokens) per sequence, cheapest first: decodes of
    1 to 64 rows (and 16 at a longer context), single prompts of 16 to `max_tokens`, chunks
    after a cached prefix, four prompts at once and a prompt beside 16 decodes; none with a
    sequence longer than `max_len`."""
    decode = (1, DECODE_CONTEXT)
    grid = [[decode] * b for b in (1, 4, 16)] + [[(1, 4 * DECODE_CONTEXT)] * 16]
    grid += [[decode] * 64] + [[(n, 0)] for n in (16, 64, 256) if n <= max_tokens]
    grid += [[(128, 0)] * 4, [(256, 0)] + [decode] * 16, [(256, 768)]]
    grid += [[(n, 0)] for n in (512, 1024) if n <= max_tokens]
    grid += [[(256, 1792)]]
    return [entries for entries in grid if all(n + c <= max_len for n, c in entries)]


def measure(executor, grid: list[list[tuple[int, ...]]], repeats: int = 5, vocab: int = 1000,
            warmups: int = 2, deadline: float = float("inf"),
            repeat_seconds: float = float("inf")) -> list[tuple[StepShape, float]]:
    """Median seconds of `executor.execute` (an executor's or a worker's) for each step
    shape of `grid`: per sequence (new tokens, cached tokens), or (1, cached tokens, k
    guesses to verify) for one that speculates. Shapes the KV cache cannot hold are skipped,
    and so is one whose run would end past the `deadline` (a perf_counter time), as the
    measured shape of most tokens, scaled by tokens, prices it. A shape's timed runs stop
    once they add up to `repeat_seconds`: cheap shapes, whose one run the machine's noise
    sways most, get all `repeats`; dear ones fewer. The timed requests are dropped afterwards."""
    rng = random.Random(0)
    info = executor.info
    bs = info.block_size
    timings, ids = [], set()
    largest = (1, 0.0)  # the measured shape of most tokens: (tokens, seconds), to scale
    for entries in grid:
        tokens = sum(e[0] + (e[2] if len(e) > 2 else 0) for e in entries)
        if time.perf_counter() + largest[1] * tokens / largest[0] > deadline:
            continue  # past the deadline, or one run of it would end past it
        new, scheduled, next_block = [], [], 0
        for i, entry in enumerate(entries):
            n, c, k = (*entry, 0)[:3]
            rid = f"timing-{i}"
            blocks = cdiv(n + c + k, bs)
            table = list(range(next_block, next_block + blocks))
            next_block += blocks
            new.append(NewRequest(rid, _tokens(rng, n + c, vocab, k > 0), [],
                                  SamplingParams(temperature=0.0), [], 1))
            # A one-token entry is a decode after c cached tokens; with k, it verifies k
            # guesses (the runner's proposer finds them in the repeating prompt).
            scheduled.append(ScheduledRequest(rid, n + k, c, table, True, n > 1))
            ids.add(rid)
        if next_block > info.num_blocks:
            log.debug("KV cache of %d blocks skips the timed shape %s x %d", info.num_blocks,
                      entries[:1], len(entries))
            continue
        out = SchedulerOutput(step=0, kind="mixed", scheduled=scheduled, new_requests=new)
        samples = []
        for k in range(repeats + warmups):
            t0 = time.perf_counter()
            executor.execute(out)  # returns Python token ids: the device has synced
            if k >= warmups:
                samples.append(time.perf_counter() - t0)
                if sum(samples) >= repeat_seconds:
                    break
        if samples:
            timings.append((StepShape.of(out), statistics.median(samples)))
            largest = max(largest, (tokens, timings[-1][1]))
    for rid in ids:
        executor.forget(rid)
    return timings


def _tokens(rng: random.Random, count: int, vocab: int, repeating: bool) -> list[int]:
    """`count` random prompt tokens; `repeating`: a random phrase of 16 over and over, which
    any proposer continues for as many guesses as it is asked."""
    phrase = [rng.randrange(10, vocab) for _ in range(16 if repeating else count)]
    return [phrase[i % len(phrase)] for i in range(count)]


def worker_grid(info: "WorkerInfo", max_len: int) -> list[list[tuple[int, int]]]:
    """The start-up grid for a worker's forward-pass size and `max_len`."""
    return startup_grid(info.max_forward_tokens or 1024, max_len)


def machine_key(info: "WorkerInfo", folder: Path, max_len: int) -> dict:
    """What a saved profile holds for: the model's files, how the worker runs them, and on
    what hardware."""
    import torch

    model = {}
    for name in ("config.json", "model.gguf", "model.safetensors"):
        path = Path(folder) / name
        if path.exists():
            st = path.stat()
            model[name] = [str(path.resolve()), st.st_size, int(st.st_mtime)]
    if info.on_gpu:
        hardware = torch.cuda.get_device_name(torch.device(info.device))
    else:
        hardware = f"{_cpu_name()}, {torch.get_num_threads()} threads"
    # A small pool skips the larger shapes: its profile is not one of a larger pool's.
    fits = sum(sum(cdiv(n + c, info.block_size) for n, c in entries) <= info.num_blocks
               for entries in worker_grid(info, max_len))
    return {"version": PROFILE_VERSION, "model": model, "hardware": hardware, "fits": fits,
            "device": info.device, "dtype": str(info.dtype), "torch": torch.__version__,
            "quantization": info.quantization,
            "block_size": info.block_size, "forward_tokens": info.max_forward_tokens,
            "decoder": info.decoder, "machine": platform.node()}


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def profile_path(key: dict) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return cache_root() / "step-profiles" / f"{digest}.json"


def measure_profile(executor, budget_s: float, vocab: int, max_len: int,
                    ) -> list[tuple[StepShape, float]]:
    """Time the start-up grid of step shapes now, within about `budget_s` seconds."""
    t0 = time.perf_counter()
    executor.touch_kv_cache()  # the grid reads contexts nobody wrote: no first-touch faults
    grid = worker_grid(executor.info, max_len)
    warm = [e for e in grid if e[0][0] == 1][:1] + [e for e in grid if e[0][0] > 1][:1]
    measure(executor, warm, repeats=0, vocab=vocab, warmups=1)  # one-time costs of each kind
    steps = measure(executor, grid, repeats=3, vocab=vocab, warmups=0, deadline=t0 + budget_s,
                    repeat_seconds=REPEAT_SECONDS)
    log.info("step times measured in %.1fs (%d shapes)", time.perf_counter() - t0, len(steps))
    return steps


def load_or_measure(executor, folder: Path, budget_s: float, vocab: int, max_len: int,
                    ) -> list[tuple[StepShape, float]]:
    """This model's step times on this machine: the saved profile, or measured now (within
    about `budget_s` seconds) and saved for the next start."""
    key = machine_key(executor.info, folder, max_len)
    path = profile_path(key)
    try:
        saved = json.loads(path.read_text())
        if saved.get("key") == key:
            return [(_shape(s), t) for s, t in saved["steps"]]
    except (OSError, ValueError, KeyError, TypeError):
        pass  # none yet, or unreadable: measure
    steps = measure_profile(executor, budget_s, vocab, max_len)
    log.info("%d step times saved to %s", len(steps), path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"key": key, "steps": [
            [[getattr(s, f) for f in StepShape.__slots__], t] for s, t in steps]}))
        tmp.replace(path)  # atomic: another core starting beside this one reads it whole
    except OSError as e:
        log.warning("could not save the step-time profile to %s: %s", path, e)
    return steps


def _shape(values: list[int]) -> StepShape:
    shape = StepShape()
    for name, value in zip(StepShape.__slots__, values, strict=True):
        setattr(shape, name, int(value))
    return shape
