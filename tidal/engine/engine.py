"""The engine: scheduler + model runner + tokenizer. `step()` schedules, executes, updates
and turns the scheduler's token outputs into text."""

from __future__ import annotations

import gc
import logging
import time

from tidal.core import (KVCacheManager, ModelOutput, Request, RequestStatus, SamplingParams,
                        Scheduler)
from tidal.core.config import CacheConfig
from tidal.engine.config import EngineConfig
from tidal.engine.detokenizer import IncrementalDetokenizer
from tidal.engine.model_runner import ModelRunner
from tidal.engine.outputs import StepUpdate
from tidal.model.registry import resolve_model
from tidal.model.tokenizer import Tokenizer

log = logging.getLogger("tidal.engine")


class Engine:
    """Runs requests to completion, one `step()` at a time, in this process."""

    def __init__(self, config: EngineConfig) -> None:
        t0 = time.perf_counter()
        self.config = config
        folder, self.model_name = resolve_model(config.model.model)
        self.runner_folder = folder
        self.tokenizer = Tokenizer(folder)
        self.runner = ModelRunner(folder, config.model, config.cache.block_size)
        arch = self.runner.arch
        sched_cfg = config.scheduler
        if sched_cfg.max_model_len > arch.max_position_embeddings:
            sched_cfg.max_model_len = arch.max_position_embeddings
        cache_cfg = CacheConfig(num_blocks=self.runner.num_blocks,
                                block_size=config.cache.block_size,
                                enable_prefix_caching=config.cache.enable_prefix_caching)
        self.scheduler = Scheduler(sched_cfg, KVCacheManager(cache_cfg))
        eos = self.tokenizer.eos_token_id
        self.eos_token_id = eos if eos is not None else (arch.eos_token_ids or (None,))[0]
        self._detok: dict[str, IncrementalDetokenizer] = {}
        self._roots: dict[str, tuple[str, int, SamplingParams]] = {}  # seq id -> root, index
        self._counter = 0
        log.info("model %s (%s, %s) loaded in %.2fs; KV cache: %d blocks x %d tokens = %.1f MiB",
                 self.model_name, self.runner.device, str(self.runner.dtype).split(".")[-1],
                 time.perf_counter() - t0, self.runner.num_blocks, cache_cfg.block_size,
                 self.runner.kv_cache_bytes / 2**20)
        gc.collect()
        gc.freeze()  # the model and the block pool are long-lived: keep them out of GC passes

    # ------------------------------------------------------------------ requests
    def tokenize(self, prompt: str) -> list[int]:
        return self.tokenizer.encode(prompt)

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams,
                    request_id: str | None = None) -> str:
        """Queue a request; raises ValueError for one that can never run."""
        if request_id is None:
            request_id = f"req-{self._counter}"
            self._counter += 1
        vocab = self.runner.arch.vocab_size
        if any(not 0 <= t < vocab for t in prompt_token_ids):
            raise ValueError(f"request {request_id!r}: token ids must be in [0, {vocab})")
        self.scheduler.add_request(Request(request_id, prompt_token_ids, params,
                                           arrival_time=time.time(),
                                           eos_token_id=self.eos_token_id))
        self._track(request_id, request_id, 0, params)
        return request_id

    def _track(self, seq_id: str, root: str, index: int, params: SamplingParams) -> None:
        self._roots[seq_id] = (root, index, params)
        self._detok[seq_id] = IncrementalDetokenizer(self.tokenizer, params.stop)

    def abort(self, request_id: str) -> None:
        self.scheduler.abort(request_id)
        for seq in [s for s, (root, _, _) in self._roots.items() if root == request_id]:
            self._forget(seq)

    def _forget(self, seq_id: str) -> None:
        self._roots.pop(seq_id, None)
        self._detok.pop(seq_id, None)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    # ------------------------------------------------------------------ one step
    def step(self) -> list[StepUpdate]:
        out = self.scheduler.schedule()
        if out.scheduled or out.block_copies:
            result = self.runner.execute(out, self.scheduler.requests)
        else:
            result = ModelOutput(preempted_ack=list(out.preempted_ids))
        updates = []
        for o in self.scheduler.update(out, result):
            if o.parent_id is not None and o.request_id not in self._roots:
                root, _, params = self._roots[o.parent_id]
                self._track(o.request_id, root, int(o.request_id.rsplit("-", 1)[1]), params)
            root, index, params = self._roots[o.request_id]
            detok = self._detok[o.request_id]
            text = detok.add(o.new_token_ids)
            finished, reason, message = o.finished, o.finish_reason, o.finish_message
            if detok.stopped and not finished:
                self.scheduler.finish_request(o.request_id, RequestStatus.FINISHED_STOPPED)
                finished, reason = True, "stop"
            if finished:
                text += detok.flush()
                self._forget(o.request_id)
            logprobs = result.logprobs.get(o.request_id)
            updates.append(StepUpdate(o.request_id, root, index, o.new_token_ids, text,
                                      finished, reason, message, logprobs))
        return updates
