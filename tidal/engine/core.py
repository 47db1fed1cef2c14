"""The engine core: the scheduler and the executor of the model's workers. Token ids in, token ids out; no text.

It runs in the caller's process under `Engine` (the offline API) or in its own process under
the server, which keeps tokenization and HTTP off the step loop.
"""

from __future__ import annotations

import gc
import logging
import math
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Callable

from tidal.core import (ERROR_QUANTILES, POLICIES, KVCacheManager, LearnedStepTime,
                        ModelOutput, PredictionLog, Request, RequestOutput, RequestStatus,
                        SamplingParams, Scheduler, SchedulerOutput, StepShape)
from tidal.core.kv_tiers import KVTiers
from tidal.core.snapshot import StepHistory
from tidal.core.speculation import GUESS_FIXED_PENALTY
from tidal.core.step_sizing import StepTarget
from tidal.engine.config import EngineConfig
from tidal.engine.executor import Executor, ExecutorDead, LocalExecutor
from tidal.engine.request_events import RequestEvents
from tidal.engine.step_profile import StepProfile
from tidal.engine.worker import Worker
from tidal.model.generation_config import end_token_ids
from tidal.model.logits_processors import check_extra_args, load_processors
from tidal.model.lora import LoRAError

log = logging.getLogger("tidal.engine")


def make_executor(config: EngineConfig, folder: str | Path) -> Executor:
    """The executor of an engine's config: one worker in this process, or the ranks of a
    tensor-parallel group (`tensor_parallel_size`) in each pipeline stage."""
    if config.parallel.world_size > 1:
        from tidal.engine.tp_executor import TensorParallelExecutor

        return TensorParallelExecutor(config, folder)
    return LocalExecutor(Worker.from_config(config, folder))


class EngineCore:
    """Owns the scheduler and the executor; `step()` schedules, executes and updates."""

    def __init__(self, config: EngineConfig, folder: str | Path,
                 eos_token_id: int | None = None) -> None:
        self.executor = make_executor(config, folder)
        info = self.executor.info
        phases = info.phases  # the worker's start, continued with the core's own phases
        arch = info.arch
        max_len = min(config.scheduler.max_model_len, arch.context_length)
        # The step-time model that sizes steps and the slo policy's plans, and adaptive
        # speculation's, learned from this engine's forward passes: each errs on its own
        # safe side (see LearnedStepTime). The first starts from this machine's profile.
        # The shapes it needs first are timed now, the rest while the engine idles.
        given, self.step_time, self.profile = config.scheduler.max_step_ms, None, None
        if ((given if given is not None else not info.on_gpu)
                or POLICIES[config.scheduler.policy].needs_step_time):
            seconds = config.model.step_profile_seconds
            if seconds:
                self.profile = StepProfile(self.executor, Path(folder), seconds,
                                           arch.vocab_size, max_len)
            prior = self.profile.measure_first() if self.profile else ()
            self.step_time = LearnedStepTime(prior=prior)
            phases.done("step profile")
        # What the model and the memory allow: the context is at most the model's, and the
        # pool is what the worker allocated; the step target is the machine's unless given,
        # on a CPU the one its step-time model prices now (it follows the model).
        follow = given is None and not info.on_gpu
        sched_cfg = replace(config.scheduler, max_model_len=max_len,
                            max_step_ms=given if given is not None or follow else 0.0)
        cache_cfg = replace(config.cache, num_blocks=info.num_blocks)
        self.config = replace(config, scheduler=sched_cfg, cache=cache_cfg)
        adaptive = sched_cfg.num_speculative_tokens and sched_cfg.speculative_adaptive
        self.step_errors = PredictionLog()  # the step-time model's, on the steps it sized
        self.guess_time = LearnedStepTime(fixed_penalty=GUESS_FIXED_PENALTY) if adaptive else None
        self._learners = [m for m in (self.step_time, self.guess_time) if m is not None]
        tiers = KVTiers(info.tier_capacity, info.tier_keys) if info.tier_capacity else None
        self.scheduler = Scheduler(sched_cfg, KVCacheManager(cache_cfg, tiers), self.step_time,
                                   guess_time=self.guess_time, step_target=(
                                       StepTarget(model=self.step_time) if follow else None))
        # the tokenizer's EOS (else config.json's first), then every end token the config lists
        self.eos_token_ids = end_token_ids(folder, eos_token_id if eos_token_id is not None
                                           else (arch.eos_token_ids or (None,))[0])
        self.vocab_size = arch.vocab_size
        self.max_model_len = sched_cfg.max_model_len
        self.processor_classes = load_processors(config.model.logits_processors)  # checks
        self.new_transfers: list[str] = []  # decode role: got blocks; their KV is to fetch
        self.prompt_tokens = 0  # prompt (and recompute) tokens run since start
        self.generation_tokens = 0  # tokens sampled since start
        self.execute_seconds = 0.0  # wall time in the model runner since start
        self.history = StepHistory()  # recent steps, for the dashboard
        self.events = RequestEvents()  # traced requests' scheduler events (SamplingParams.trace)
        # Async scheduling: one worker thread runs the forward pass (torch releases the GIL).
        self._depth = sched_cfg.steps_in_flight  # steps the executor holds at once
        self._pool = (ThreadPoolExecutor(1, "tidal-step")
                      if sched_cfg.async_scheduling and self._depth == 1 else None)
        self._pending: tuple[SchedulerOutput, Future] | None = None
        self._in_flight: deque[tuple[SchedulerOutput, float]] = deque()  # launched steps
        self.paused = False  # plans no step (pause mode keep): requests keep their blocks
        phases.done("scheduler")
        log.info("model loaded in %.2fs (%s; %s, %s, decode steps %s); KV cache: %d blocks "
                 "x %d tokens = %.1f MiB%s; step target %s", phases.total, phases, info.device,
                 str(info.dtype).split(".")[-1],
                 "through the C++ decoder" if info.decoder else "in PyTorch", info.num_blocks,
                 cache_cfg.block_size, info.kv_cache_bytes / 2**20,
                 "" if info.kv_cache_dtype == "auto" else f" of {info.kv_cache_dtype} rows",
                 f"{self.step_target_ms():g} ms" if self.step_target_ms() else "none")
        gc.collect()
        gc.freeze()  # the model and the block pool are long-lived: keep them out of GC passes

    def step_target_ms(self) -> float:
        """The milliseconds steps are sized to now (0: none)."""
        seconds = self.scheduler.target.seconds
        return round(seconds * 1000, 1) if seconds < math.inf else 0.0

    def step_time_error(self) -> list[float]:
        """The step-time model's predicted / measured seconds over recent steps at each of
        ERROR_QUANTILES; empty without a model or before its first prediction."""
        if self.step_time is None or not self.step_errors.ratios:
            return []
        return self.step_errors.quantiles(*ERROR_QUANTILES)

    def add(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
            arrival_time: float | None = None) -> None:
        """Queue a request; raises ValueError for one that can never run."""
        for what, ids in (("token ids", prompt_token_ids),
                          ("stop_token_ids", params.stop_token_ids),
                          ("logit_bias token ids", params.logit_bias),
                          ("allowed_token_ids", params.allowed_token_ids or ()),
                          ("prediction token ids", params.prediction or ()),
                          ("bad_words_token_ids",
                           [t for ids in params.bad_words_token_ids for t in ids])):
            if any(not 0 <= t < self.vocab_size for t in ids):
                raise ValueError(f"request {request_id!r}: {what} must be in "
                                 f"[0, {self.vocab_size})")
        check_extra_args(self.processor_classes, params.extra_args)
        if params.lora is not None:
            adapters = self.executor.adapters()
            if adapters is None or params.lora not in adapters:
                raise ValueError(f"request {request_id!r}: unknown LoRA adapter "
                                 f"{params.lora!r}" + ("" if adapters is not None else
                                                       " (LoRA is not enabled: enable_lora)"))
            self.executor.load_adapter(params.lora)  # from its folder now: not in a step
        arrival = time.time() if arrival_time is None else arrival_time
        self.scheduler.add_request(Request(request_id, prompt_token_ids, params,
                                           arrival_time=arrival, eos_token_ids=self.eos_token_ids))
        if params.trace:
            self.events.add(request_id, arrival)

    def reset_prefix_cache(self) -> int:
        """vLLM's: forget every cached prefix of the pool (KVCacheManager.reset_prefix_cache);
        how many blocks were forgotten."""
        forgotten = self.scheduler.kv.reset_prefix_cache()
        log.info("prefix cache reset: %d cached blocks forgotten", forgotten)
        return forgotten

    def set_adapters(self, adapters: dict[str, str]) -> None:
        """Serve exactly these LoRA adapters (name -> folder): load the new ones, forget
        those gone; one that fails to load is logged and left out."""
        served = self.executor.adapters()
        if served is None:
            log.error("LoRA adapters sent to a core without LoRA enabled")
            return
        for name in [n for n, path in served.items() if adapters.get(n) != path]:
            self.executor.unregister_adapter(name)
        for name, path in adapters.items():
            if name not in served or served[name] != path:
                try:
                    self.executor.register_adapter(name, path)
                except LoRAError as e:
                    log.error("%s", e)

    def pause(self) -> None:
        """Plan no more steps (vLLM's pause mode `keep`, SGLang's `in_place`): the steps in
        flight complete; every request keeps its blocks, tokens and place until `resume`,
        and new requests wait in the queue."""
        if not self.paused:
            self.paused = True
            log.info("paused: %d requests held", len(self.scheduler.requests))

    def resume(self) -> None:
        """Plan steps again: the held requests go on as if never paused."""
        if self.paused:
            self.paused = False
            log.info("resumed")

    def abort(self, request_id: str) -> None:
        """End a request and its n>1 siblings, from any state; their blocks return now."""
        self.scheduler.abort(request_id)
        self.events.forget(request_id)

    def finish(self, seq_id: str) -> None:
        """End one sequence that met a stop string (found by the detokenizer)."""
        self.scheduler.finish_request(seq_id, RequestStatus.FINISHED_STOPPED)
        self.events.forget(seq_id)

    def fail(self, request_id: str, message: str) -> list[RequestOutput]:
        """End a request with `error`, freeing its blocks; its final output (none if it
        had already ended)."""
        if not self.scheduler.finish_request(request_id, RequestStatus.FINISHED_ERROR, message):
            return []
        return [RequestOutput(request_id, [], True, "error", message)]

    def has_work(self) -> bool:
        """Whether requests, stores or steps are in the engine (paused or not)."""
        return self._plannable() or self._pending is not None or bool(self._in_flight)

    def _plannable(self) -> bool:
        """Whether a step would have anything to plan: requests, or blocks to store."""
        return self.scheduler.has_unfinished_requests() or self._stores_pending()

    def _to_plan(self) -> bool:
        """Whether the next step is to be planned: something to plan, and not paused."""
        return not self.paused and self._plannable()

    def _stores_pending(self) -> bool:
        tiers = self.scheduler.kv.tiers
        return tiers is not None and tiers.pending

    def profiling(self) -> bool:
        """Whether shapes of the step-time profile are left to time while idle."""
        return self.profile is not None and not self.profile.done

    def profile_idle(self) -> bool:
        """Time the next shape of the step-time profile, on free KV blocks lent by the
        pool, if no request is in the engine; whether one was timed. A request that arrives
        meanwhile waits for that shape's runs (up to a second or two on a small CPU)."""
        if not self.profiling() or self.has_work():
            return False
        pool, need = self.scheduler.kv.pool, self.profile.blocks_next()
        # Never-used blocks come first in the free queue, cached prefixes last; a shape the
        # pool cannot hold is lent none (and skipped).
        lent = pool.allocate(need) if need <= pool.num_free else []
        try:
            steps = self.profile.measure_next([b.block_id for b in lent])
        finally:
            pool.give_back(lent)
        self.step_time.add_prior(steps)
        return True

    def cut_steps_when(self, live_waiting: Callable[[], bool]) -> bool:
        """Let a step that computes a background prompt's chunk stop between layers once
        `live_waiting()` (tidal/core/step_cut.py), where steps run one at a time on workers
        that can stop (the executor's `cut_when`); whether they may."""
        return self._pool is None and self._depth == 1 and self.executor.cut_when(live_waiting)

    def can_step(self) -> bool:
        """Whether a step would do anything: requests that only await their KV from a
        prefill instance (decode role) need none; while paused only steps in flight do."""
        s = self.scheduler
        ready = bool(s.running or s.waiting or s.preempted) or self._stores_pending()
        return (ready and not self.paused) or self._pending is not None or bool(self._in_flight)

    def step(self) -> list[RequestOutput]:
        """One step: the requests' new tokens (and finishes), each with its tokens' logprobs
        and, on its first token, its prompt logprobs where it asked for them. With async
        scheduling these are the previous step's, and the next one is running."""
        if self._depth > 1:
            return self._step_pipelined()
        if self._pool is not None:
            return self._step_overlapped()
        if self.paused:
            return []
        out = self._schedule()
        return self._complete(out, self._execute(out))

    def _step_pipelined(self) -> list[RequestOutput]:
        """Several steps in the executor at once (pipeline stages, one each): plan a step
        of requests no step in flight holds (the scheduler keeps them apart) and launch
        it, then complete the oldest once the pipeline is full or nothing new could start.
        Steps complete in launch order, so a preemption's ack, a finished request's
        forgetting and a re-admission reach the runner after every step that held it."""
        out = self._schedule() if self._to_plan() else None
        started = out is not None and (_moves(out) or bool(out.preempted_ids))
        if started:
            for s in out.scheduled:  # the runner reads them later: tables grow in place
                s.block_ids = list(s.block_ids)
            self._in_flight.append((out, time.perf_counter()))
            self._launch(out)  # the stages overlap in their own processes: no thread here
        if not self._in_flight or (started and len(self._in_flight) < self._depth):
            return []
        prev, t0 = self._in_flight.popleft()
        return self._complete(prev, self._collect(prev, t0))

    def _launch(self, out: SchedulerOutput) -> None:
        self.prompt_tokens += _prefill_tokens(out)
        self.executor.launch(out)

    def _collect(self, out: SchedulerOutput, t0: float) -> ModelOutput:
        result = self.executor.complete()
        self._observe(out, result, time.perf_counter() - t0)
        return result

    def _step_overlapped(self) -> list[RequestOutput]:
        """Plan step N+1 while step N runs on the worker thread, then wait for N, update,
        and start N+1. The runner reads only the plan's plain data; its block tables are
        snapshotted, as tables grow in place."""
        out = self._schedule() if self._to_plan() else None
        done: list[RequestOutput] = []
        if self._pending is not None:
            prev, future = self._pending
            self._pending = None
            done = self._complete(prev, future.result())
        if out is not None:
            live = self.scheduler.requests
            # A request that finished in the update above was planned before it: skip it,
            # its blocks are already free (update() drops whatever it would have produced).
            out.scheduled = [s for s in out.scheduled if s.request_id in live]
            for s in out.scheduled:
                s.block_ids = list(s.block_ids)
            self._pending = (out, self._pool.submit(self._execute, out))
        return done

    def _learn_tiers(self) -> None:
        """The tiers' report: before each plan (what other cores of this machine wrote to
        the disk tier), and after each step (host memory's figures, for the stats)."""
        tiers = self.scheduler.kv.tiers
        if tiers is not None:
            tiers.learn(self.executor.tier_report())

    def _schedule(self) -> SchedulerOutput:
        self._learn_tiers()
        out = self.scheduler.schedule()
        if self.events:  # traced requests: what this plan does to them
            self.events.planned(out, time.time())
        self.new_transfers.extend(out.transfer_ids)
        return out

    def _execute(self, out: SchedulerOutput) -> ModelOutput | Exception:
        if not _moves(out):
            return ModelOutput(preempted_ack=list(out.preempted_ids))
        self.prompt_tokens += _prefill_tokens(out)
        t0 = time.perf_counter()
        try:
            result = self.executor.execute(out)
        except ExecutorDead:
            raise  # no step can run any more: the core stops (a server restarts it)
        except Exception as exc:  # the step's requests fail; the engine serves the rest
            log.exception("model runner failed; ending the step's %d requests",
                          len(out.scheduled))
            return exc
        finally:
            seconds = time.perf_counter() - t0
        if result.cut:  # its tokens count when it runs again; its time is no step's to learn
            self.prompt_tokens -= _prefill_tokens(out)
            self.execute_seconds += seconds
            return result
        self._observe(out, result, seconds)
        return result

    def _observe(self, out: SchedulerOutput, result: ModelOutput, seconds: float) -> None:
        """A step's time (launch to output), for the step-time models and the history."""
        self.execute_seconds += seconds
        predicted = 0.0
        if self._learners:
            sched = self.scheduler
            shape = StepShape.of(out, sched.requests if sched.loras.seen else None)
            if self.step_time is not None:
                predicted = self.step_time.shape_time(shape)
                self.step_errors.record(predicted, seconds)
            for model in self._learners:
                model.observe(shape, seconds)
        accepted = sum(len(result.sampled[rid]) - 1 for rid in result.drafted)
        self.history.record(out, seconds, time.time(), _prefill_tokens(out), accepted,
                            predicted)

    def _complete(self, out: SchedulerOutput, result: ModelOutput | Exception,
                  ) -> list[RequestOutput]:
        if isinstance(result, Exception):
            message = f"model runner error: {type(result).__name__}: {result}"
            failed = [o for s in out.scheduled for o in self.fail(s.request_id, message)]
            self.scheduler.update(out, ModelOutput(preempted_ack=list(out.preempted_ids)))
            return failed
        failed = [o for rid, why in result.failed.items() for o in self.fail(rid, why)]
        self.generation_tokens += sum(len(t) for t in result.sampled.values())
        outputs = failed + self.scheduler.update(out, result)
        self._learn_tiers()
        if self.events:
            self.events.attach(outputs)
        if result.logprobs or result.prompt_logprobs or result.embeddings:
            attach_row_data(outputs, result)  # a step without them pays nothing
        return outputs

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        if self._stores_pending():  # blocks published by the last steps
            self.executor.execute(SchedulerOutput(
                step=-1, kind="idle", kv_stores=self.scheduler.kv.tiers.take_stores()))
        self.executor.close()


def _moves(out: SchedulerOutput) -> bool:
    """Whether a plan has the executor do anything: compute, copy or move blocks, or learn
    of requests that start or end."""
    return bool(out.scheduled or out.block_copies or out.new_requests or out.finished_ids
                or out.kv_stores or out.kv_loads)


def _prefill_tokens(out: SchedulerOutput) -> int:
    return sum(s.num_new_tokens for s in out.scheduled if s.is_prefill)


def attach_row_data(outputs: list[RequestOutput], result: ModelOutput) -> None:
    """Put each sampled row's logprobs on the outputs its tokens went to, and a request's
    prompt logprobs and embedding on the output of its first token. An n>1 request's row
    holds every sibling's first token: entry i is sibling i's (the parent is 0)."""
    rows, prompt, embeddings = result.logprobs, result.prompt_logprobs, result.embeddings
    for o in outputs:
        count = len(o.new_token_ids)
        if not count:
            continue  # ended without a token: nothing was sampled for it
        row = rows.get(o.request_id)
        if row is not None:
            o.logprobs = row[:count]
        elif o.parent_id in rows:  # a sibling's first token, sampled in its parent's row
            o.logprobs = rows[o.parent_id][o.index:o.index + count]
        if prompt:
            o.prompt_logprobs = prompt.get(o.request_id)
        if embeddings:
            o.embedding = embeddings.get(o.request_id)
