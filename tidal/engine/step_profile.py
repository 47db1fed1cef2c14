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
from tidal.core.step_sizing import EFFICIENT_CHUNK
from tidal.model.registry import cache_root, model_files

if TYPE_CHECKING:
    from tidal.engine.worker import WorkerInfo

log = logging.getLogger("tidal.engine")

PROFILE_VERSION = 4  # bump when the grid or the runner's timing changes meaning
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
            repeat_seconds: float = float("inf"),
            blocks: list[int] | None = None) -> list[tuple[StepShape, float]]:
    """Median seconds of `executor.execute` (an executor's or a worker's) for each step
    shape of `grid`: per sequence (new tokens, cached tokens), or (1, cached tokens, k
    guesses to verify) for one that speculates, over the KV blocks `blocks` (all of the
    pool's by default). Shapes those blocks cannot hold are skipped, and so is one whose
    run would end past the `deadline` (a perf_counter time), as the measured shape of most
    tokens, scaled by tokens, prices it. A shape's timed runs stop once they add up to
    `repeat_seconds`: cheap shapes, whose one run the machine's noise sways most, get all
    `repeats`; dear ones fewer. The timed requests are dropped afterwards."""
    rng = random.Random(0)
    blocks = list(range(executor.info.num_blocks)) if blocks is None else blocks
    timings = []
    largest = (1, 0.0)  # the measured shape of most tokens: (tokens, seconds), to scale
    for entries in grid:
        tokens = shape_tokens(entries)
        if time.perf_counter() + largest[1] * tokens / largest[0] > deadline:
            continue  # past the deadline, or one run of it would end past it
        timed = time_shape(executor, entries, blocks, rng, vocab, repeats, warmups,
                           repeat_seconds)
        if timed is not None:
            timings.append(timed)
            largest = max(largest, (tokens, timed[1]))
    return timings


def shape_tokens(entries: list[tuple[int, ...]]) -> int:
    """The positions one run of a grid shape computes."""
    return sum(e[0] + (e[2] if len(e) > 2 else 0) for e in entries)


def shape_blocks(entries: list[tuple[int, ...]], block_size: int) -> int:
    """The KV blocks a grid shape's sequences hold."""
    return sum(cdiv(sum(e), block_size) for e in entries)


def time_shape(executor, entries: list[tuple[int, ...]], blocks: list[int],
               rng: random.Random, vocab: int, repeats: int, warmups: int,
               repeat_seconds: float) -> tuple[StepShape, float] | None:
    """(shape, median seconds) of one grid shape run on `blocks`, whose pages it writes
    first (a pool's untouched pages would time the OS mapping them); None when the blocks
    cannot hold it. The timed requests are dropped afterwards."""
    bs = executor.info.block_size
    if shape_blocks(entries, bs) > len(blocks):
        log.debug("KV cache of %d blocks skips the timed shape %s x %d", len(blocks),
                  entries[:1], len(entries))
        return None
    new, scheduled, used = [], [], 0
    for i, entry in enumerate(entries):
        n, c, k = (*entry, 0)[:3]
        rid = f"timing-{i}"
        table = blocks[used:used + cdiv(n + c + k, bs)]
        used += len(table)
        new.append(NewRequest(rid, _tokens(rng, n + c, vocab, k > 0), [],
                              SamplingParams(temperature=0.0), [], 1))
        # A one-token entry is a decode after c cached tokens; with k, it verifies k
        # guesses (the runner's proposer finds them in the repeating prompt).
        scheduled.append(ScheduledRequest(rid, n + k, c, table, True, n > 1))
    executor.touch_kv_cache(blocks[:used])
    out = SchedulerOutput(step=0, kind="mixed", scheduled=scheduled, new_requests=new)
    samples = []
    for k in range(repeats + warmups):
        t0 = time.perf_counter()
        executor.execute(out)  # returns Python token ids: the device has synced
        if k >= warmups:
            samples.append(time.perf_counter() - t0)
            if sum(samples) >= repeat_seconds:
                break
    for s in scheduled:
        executor.forget(s.request_id)
    return (StepShape.of(out), statistics.median(samples)) if samples else None


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

    model = model_files(folder)
    if info.on_gpu:
        hardware = torch.cuda.get_device_name(torch.device(info.device))
    else:
        hardware = f"{_cpu_name()}, {torch.get_num_threads()} threads"
    # A small pool skips the larger shapes: its profile is not one of a larger pool's.
    fits = sum(sum(cdiv(n + c, info.block_size) for n, c in entries) <= info.num_blocks
               for entries in worker_grid(info, max_len))
    return {"version": PROFILE_VERSION, "model": model, "hardware": hardware, "fits": fits,
            "device": info.device, "dtype": str(info.dtype), "torch": torch.__version__,
            "quantization": info.quantization, "kv_cache_dtype": info.kv_cache_dtype,
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


def first_shape(entries: list[tuple[int, int]]) -> bool:
    """A shape timed before the engine serves: one decode row and four. No prompt: a 1B
    model's prompt chunk takes seconds on two cores, and until the model prices prompts
    the step target caps a step's prompt tokens at its chunk (`StepTarget.prompt_cap`)."""
    return entries in ([(1, DECODE_CONTEXT)], [(1, DECODE_CONTEXT)] * 4)


def idle_order(grid: list[list[tuple[int, int]]]) -> list[list[tuple[int, int]]]:
    """The shapes timed while idle: the prompt chunk that prices the CPU step target
    (`default_step_target`) first, as it is what the model prices next; from a shorter
    prompt alone the fit cannot tell its tokens' cost from their attention's and misprices
    the chunk by up to 1.8x."""
    chunk = [(EFFICIENT_CHUNK, 0)]
    return sorted(grid, key=lambda entries: entries != chunk)  # stable: the rest in order


class StepProfile:
    """This model's step times on this machine (`steps`): the profile an earlier start
    saved, or the start-up grid measured in two parts, a few shapes before the engine
    serves (`measure_first`) and the rest a shape at a time while it idles
    (`measure_next`), within about `budget_s` seconds of timing in all, then saved for the
    next start. A server is ready in a second where timing the whole grid took ten."""

    def __init__(self, executor, folder: Path, budget_s: float, vocab: int,
                 max_len: int) -> None:
        self.executor, self.vocab, self.budget_s = executor, vocab, budget_s
        self.key = machine_key(executor.info, folder, max_len)
        self.path = profile_path(self.key)
        self.steps: list[tuple[StepShape, float]] = self._load()
        self.pending = [] if self.steps else idle_order(worker_grid(executor.info, max_len))
        self.spent = 0.0  # seconds of timing so far
        self.largest = (1, 0.0)  # the measured shape of most tokens: (tokens, seconds)
        self._rng = random.Random(0)
        # One decode row as timed before serving: the yardstick of the machine's speed then.
        self.reference: tuple[list[tuple[int, int]], float] | None = None

    @property
    def done(self) -> bool:
        return not self.pending

    def _load(self) -> list[tuple[StepShape, float]]:
        try:
            saved = json.loads(self.path.read_text())
            if saved.get("key") == self.key:
                return [(_shape(s), t) for s, t in saved["steps"]]
        except (OSError, ValueError, KeyError, TypeError):
            pass  # none yet, or unreadable: measure
        return []

    def measure_first(self) -> list[tuple[StepShape, float]]:
        """Warm the runner up (one decode run: one-time costs; a prompt's first run is no
        slower than its next) and time the shapes the engine needs before it serves; the
        steps known so far."""
        if self.done:
            return list(self.steps)
        t0 = time.perf_counter()
        first = [e for e in self.pending if first_shape(e)]
        measure(self.executor, first[:1], repeats=0, vocab=self.vocab, warmups=1)
        for entries in first:
            self._time(entries, list(range(self.executor.info.num_blocks)))
        if self.steps and first[0] == [(1, DECODE_CONTEXT)]:
            self.reference = (first[0], self.steps[0][1])
        log.info("%d step times measured in %.1fs before serving; %d more while idle",
                 len(self.steps), time.perf_counter() - t0, len(self.pending))
        return list(self.steps)

    def blocks_next(self) -> int:
        """The KV blocks the next pending shape (and the yardstick timed beside it) holds."""
        if not self.pending:
            return 0
        bs = self.executor.info.block_size
        shapes = [self.pending[0]] + ([self.reference[0]] if self.reference else [])
        return max(shape_blocks(e, bs) for e in shapes)

    def measure_next(self, blocks: list[int]) -> list[tuple[StepShape, float]]:
        """Time the next pending shape on the free KV blocks `blocks` (its own or skip it:
        too few blocks, or past the budget); the steps it added. The last one saves the
        profile. The shape's time is scaled by the yardstick's then over now: an idle
        engine's machine may be busy with other work (a client's own), which must not
        price every later start's steps."""
        if self.done:
            return []
        entries = self.pending[0]
        tokens = shape_tokens(entries)
        before = len(self.steps)
        if self.spent + self.largest[1] * tokens / self.largest[0] <= self.budget_s:
            scale = 1.0
            if self.reference is not None:
                now = time_shape(self.executor, self.reference[0], blocks, self._rng,
                                 self.vocab, repeats=5, warmups=0,
                                 repeat_seconds=REPEAT_SECONDS)
                scale = self.reference[1] / now[1] if now is not None else 1.0
            self._time(entries, blocks, scale)
        else:
            self.pending.pop(0)  # one run of it would end past the budget
        if self.done:
            self._save()
        return self.steps[before:]

    def measure_all(self) -> list[tuple[StepShape, float]]:
        """The whole profile now, over the whole pool (where no engine idles between
        requests: a test, a benchmark); the steps."""
        self.measure_first()
        while not self.done:
            self.measure_next(list(range(self.executor.info.num_blocks)))
        return list(self.steps)

    def _time(self, entries: list[tuple[int, int]], blocks: list[int],
              scale: float = 1.0) -> None:
        self.pending.remove(entries)
        t0 = time.perf_counter()
        timed = time_shape(self.executor, entries, blocks, self._rng, self.vocab, repeats=3,
                           warmups=0, repeat_seconds=REPEAT_SECONDS)
        self.spent += time.perf_counter() - t0
        if timed is not None:
            self.steps.append((timed[0], timed[1] * scale))
            self.largest = max(self.largest, (shape_tokens(entries), timed[1]))

    def _save(self) -> None:
        log.info("%d step times measured in %.1fs, saved to %s", len(self.steps), self.spent,
                 self.path)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps({"key": self.key, "steps": [
                [[getattr(s, f) for f in StepShape.__slots__], t] for s, t in self.steps]}))
            tmp.replace(self.path)  # atomic: another core starting beside this one reads it whole
        except OSError as e:
            log.warning("could not save the step-time profile to %s: %s", self.path, e)


def _shape(values: list[int]) -> StepShape:
    shape = StepShape()
    for name, value in zip(StepShape.__slots__, values, strict=True):
        setattr(shape, name, int(value))
    return shape
