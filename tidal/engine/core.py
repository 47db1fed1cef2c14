"""The engine core: the scheduler and the model runner. Token ids in, token ids out; no text.

It runs in the caller's process under `Engine` (the offline API) or in its own process under
the server, which keeps tokenization and HTTP off the step loop.
"""

from __future__ import annotations

import gc
import logging
import time
from pathlib import Path

from tidal.core import (KVCacheManager, ModelOutput, Request, RequestOutput, RequestStatus,
                        SamplingParams, Scheduler)
from tidal.core.config import CacheConfig
from tidal.engine.config import EngineConfig
from tidal.engine.model_runner import ModelRunner

log = logging.getLogger("tidal.engine")


class EngineCore:
    """Owns the scheduler and the model runner; `step()` schedules, executes and updates."""

    def __init__(self, config: EngineConfig, folder: str | Path,
                 eos_token_id: int | None = None) -> None:
        t0 = time.perf_counter()
        self.config = config
        self.runner = ModelRunner(folder, config.model, config.cache.block_size)
        arch = self.runner.arch
        sched_cfg = config.scheduler
        if sched_cfg.max_model_len > arch.max_position_embeddings:
            sched_cfg.max_model_len = arch.max_position_embeddings
        cache_cfg = CacheConfig(num_blocks=self.runner.num_blocks,
                                block_size=config.cache.block_size,
                                enable_prefix_caching=config.cache.enable_prefix_caching)
        self.scheduler = Scheduler(sched_cfg, KVCacheManager(cache_cfg))
        self.eos_token_id = (eos_token_id if eos_token_id is not None
                             else (arch.eos_token_ids or (None,))[0])
        self.vocab_size = arch.vocab_size
        self.max_model_len = sched_cfg.max_model_len
        self.prompt_tokens = 0  # prompt (and recompute) tokens run since start
        self.generation_tokens = 0  # tokens sampled since start
        log.info("model loaded in %.2fs (%s, %s); KV cache: %d blocks x %d tokens = %.1f MiB",
                 time.perf_counter() - t0, self.runner.device,
                 str(self.runner.dtype).split(".")[-1], self.runner.num_blocks,
                 cache_cfg.block_size, self.runner.kv_cache_bytes / 2**20)
        gc.collect()
        gc.freeze()  # the model and the block pool are long-lived: keep them out of GC passes

    def add(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
            arrival_time: float | None = None) -> None:
        """Queue a request; raises ValueError for one that can never run."""
        if any(not 0 <= t < self.vocab_size for t in prompt_token_ids):
            raise ValueError(f"request {request_id!r}: token ids must be in "
                             f"[0, {self.vocab_size})")
        self.scheduler.add_request(Request(
            request_id, prompt_token_ids, params,
            arrival_time=time.time() if arrival_time is None else arrival_time,
            eos_token_id=self.eos_token_id))

    def abort(self, request_id: str) -> None:
        """End a request and its n>1 siblings, from any state; their blocks return now."""
        self.scheduler.abort(request_id)

    def finish(self, seq_id: str) -> None:
        """End one sequence that met a stop string (found by the detokenizer)."""
        self.scheduler.finish_request(seq_id, RequestStatus.FINISHED_STOPPED)

    def has_work(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> tuple[list[RequestOutput], dict[str, list]]:
        """One step: the requests' new tokens (and finishes), and logprobs by request id."""
        out = self.scheduler.schedule()
        if not (out.scheduled or out.block_copies):
            return self.scheduler.update(out, ModelOutput(preempted_ack=list(out.preempted_ids))), {}
        # One-token entries are decodes (a one-token prefill chunk, rare, counts as one too).
        self.prompt_tokens += sum(s.num_new_tokens for s in out.scheduled if s.num_new_tokens > 1)
        try:
            result = self.runner.execute(out, self.scheduler.requests)
        except Exception as exc:  # fail this step's requests, keep serving the rest
            log.exception("model runner failed; ending the step's %d requests",
                          len(out.scheduled))
            message = f"model runner error: {type(exc).__name__}: {exc}"
            failed = [s.request_id for s in out.scheduled]
            for rid in failed:
                self.scheduler.finish_request(rid, RequestStatus.FINISHED_ERROR, message)
            self.scheduler.update(out, ModelOutput(preempted_ack=list(out.preempted_ids)))
            return [RequestOutput(rid, [], True, "error", message) for rid in failed], {}
        self.generation_tokens += sum(len(t) for t in result.sampled.values())
        return self.scheduler.update(out, result), result.logprobs
