"""Prometheus metrics at /metrics, named like vLLM's with a `tidal:` prefix and, as vLLM's,
labelled with the served `model_name`. Engine-side figures come from the core's latest
Stats message; latencies are observed per request here."""

from __future__ import annotations

import time
from collections import deque

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from tidal.core.step_time import ERROR_QUANTILES, STEP_TIME_TERMS
from tidal.engine.outputs import StepUpdate

_LATENCY = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0)
_REQUEST = (0.1, 0.3, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0)
_N = (1, 2, 5, 10, 20)
_TOKENS = tuple(step * 10**e for e in range(7) for step in (1, 2, 5))  # vLLM's 1-2-5 steps


class _CoreCollector:
    """Reads the engine core's latest stats at scrape time."""

    def __init__(self, client, model_name: str) -> None:
        self.client, self.model = client, model_name

    def _family(self, kind, name: str, doc: str, value: float | None = None, labels=()):
        """A gauge or counter family labelled with the model (and `labels`)."""
        family = kind(name, doc, labels=["model_name", *labels])
        if value is not None:
            family.add_metric([self.model], value)
        return family

    def collect(self):
        yield from self._liveness()
        stats = self.client.stats
        if stats is None:
            return
        s = stats.scheduler
        gauges = [
            ("tidal:num_requests_running", "Requests prefilling or decoding.",
             s.running_decode + s.running_prefill),
            ("tidal:num_requests_decoding", "Requests past their prompts, decoding.",
             s.running_decode),
            ("tidal:num_requests_waiting", "Requests queued for admission.", s.waiting),
            ("tidal:num_requests_preempted", "Retracted requests awaiting re-admission.",
             s.preempted),
            ("tidal:kv_cache_usage_perc", "Share of KV blocks in use (0-1).", s.kv_usage),
            ("tidal:kv_cache_used_blocks", "KV blocks in use.", s.used_blocks),
            ("tidal:prefix_cache_hit_rate", "Prompt tokens served from the prefix cache (0-1).",
             s.prefix_hit_rate),
            ("tidal:new_token_ratio", "Decode reservation ratio of the scheduler.",
             s.new_token_ratio),
            ("tidal:spec_decode_acceptance_rate", "Share of guessed tokens accepted (0-1).",
             s.spec_accepted_tokens / max(1, s.spec_draft_tokens)),
        ]
        gauges.append(("tidal:max_step_seconds", "The step-time target steps are sized to "
                       "now (max_step_ms; 0: none).", stats.max_step_ms / 1000))
        for name, doc, value in gauges:
            yield self._family(GaugeMetricFamily, name, doc, value)
        if stats.step_time_error:
            error = self._family(GaugeMetricFamily, "tidal:step_time_prediction_ratio",
                                 "The step-time model's predicted over measured step seconds "
                                 "over recent steps, by quantile (1: exact).",
                                 labels=["quantile"])
            for q, value in zip(ERROR_QUANTILES, stats.step_time_error):
                error.add_metric([self.model, str(q)], value)
            yield error
        if stats.step_time_coef:
            coef = self._family(GaugeMetricFamily, "tidal:step_time_coefficient",
                                "The step-time model's seconds per unit of each term: per "
                                "step, new token, sequence, attention pair, KV token, LoRA "
                                "adapter and token through an adapter.",
                                labels=["term"])
            for term, value in zip(STEP_TIME_TERMS, stats.step_time_coef):
                coef.add_metric([self.model, term], value)
            yield coef
        counters = [
            ("tidal:num_preemptions", "Retractions since start.", s.num_preemptions),
            ("tidal:num_steps_cut", "Steps of background work cut short for a live request "
             "since start.", s.num_steps_cut),
            ("tidal:prefix_cache_queries", "Tokens looked up in the prefix cache, at each "
             "admission.", s.prefix_query_tokens),
            ("tidal:prefix_cache_hits", "Of those, the tokens the prefix cache (or a tier "
             "below it) held.", s.prefix_hit_tokens),
            ("tidal:prompt_tokens", "Prompt tokens computed (prefix-cache hits excluded).",
             stats.prompt_tokens),
            ("tidal:generation_tokens", "Tokens generated.", stats.generation_tokens),
            ("tidal:num_steps", "Engine steps since start.", s.num_steps),
            ("tidal:model_execute_seconds", "Wall time in the model runner.",
             stats.execute_seconds),
            ("tidal:engine_step_seconds", "Wall time of engine steps (schedule, execute, "
             "update, send outputs).", stats.step_seconds),
            ("tidal:spec_decode_num_drafts", "Speculative verifications (decode steps of a "
             "request that guessed).", s.spec_drafts),
            ("tidal:spec_decode_num_draft_tokens", "Guessed tokens verified.",
             s.spec_draft_tokens),
            ("tidal:spec_decode_num_accepted_tokens", "Guessed tokens accepted.",
             s.spec_accepted_tokens),
            ("tidal:spec_decode_num_emitted_tokens", "Tokens emitted by verifications: the "
             "accepted guesses and the model's own token after them.",
             s.spec_accepted_tokens + s.spec_drafts),
        ]
        config = getattr(self.client, "config", None)
        ready = getattr(self.client, "ready", None)
        block = ready.block_bytes if ready is not None else 0
        if block:  # every core's pool, in its --kv-cache-dtype
            yield self._family(GaugeMetricFamily, "tidal:kv_cache_bytes", "Bytes of the KV "
                               "pools' blocks (every layer's K and V).", block * s.num_blocks)
        # the tiers below the pool, named by the lowest: the disk (host memory above it
        # caches it: every block is on disk too), or host memory alone
        tier = (None if config is None else "disk" if config.model.kv_cache_dir is not None
                else "host" if config.model.kv_host_memory else None)
        if tier is not None:
            where = f"the {tier} tier"
            above = tier == "disk" and config.model.kv_host_memory
            gauges = [(f"tidal:kv_{tier}_blocks", f"KV blocks {where} holds.", s.tier_blocks),
                      (f"tidal:kv_{tier}_bytes", f"Bytes of KV {where} holds (file headers "
                       "aside).", s.tier_blocks * block),
                      (f"tidal:kv_{tier}_load_seconds_per_block", "Seconds a block takes to "
                       "load from the tiers (a moving average).", s.tier_load_ms / 1000)]
            if above:
                gauges += [("tidal:kv_host_blocks", "KV blocks host memory above the disk "
                            "holds.", s.tier_memory_blocks),
                           ("tidal:kv_host_bytes", "Bytes of KV host memory above the disk "
                            "holds.", s.tier_memory_blocks * block)]
                counters.append(("tidal:kv_host_loaded_blocks", "KV blocks loaded whole "
                                 "from host memory above the disk.", s.tier_memory_hit_blocks))
            for name, doc, value in gauges:
                yield self._family(GaugeMetricFamily, name, doc, value)
            counters += [
                (f"tidal:kv_{tier}_loaded_blocks", f"KV blocks loaded whole from {where} "
                 "(prefix hits it served).", s.tier_hit_blocks - s.tier_memory_hit_blocks),
                (f"tidal:kv_{tier}_stored_blocks", f"KV blocks stored to {where}.",
                 s.tier_stored_blocks),
                (f"tidal:kv_{tier}_failed_loads", f"Loads from {where} that found a block "
                 "missing or corrupt (computed instead).", s.tier_failed_blocks)]
        for name, doc, value in counters:
            yield self._family(CounterMetricFamily, name, doc, value)
        lora = getattr(config, "lora", None)
        if lora is not None and lora.enable_lora:  # vLLM's: the value is the time of the info
            info = self._family(GaugeMetricFamily, "tidal:lora_requests_info",
                                "LoRA adapters of running and waiting requests.",
                                labels=["max_lora", "running_lora_adapters",
                                        "waiting_lora_adapters"])
            info.add_metric([self.model, str(self.client.config.scheduler.max_loras),
                             ",".join(s.running_loras), ",".join(s.waiting_loras)], time.time())
            yield info
        dispatcher = getattr(self.client, "dispatcher", None)
        if dispatcher is not None:
            routed = self._family(CounterMetricFamily, "tidal:dp_requests_routed",
                                  "Requests the dispatcher sent to each core.", labels=["core"])
            for i, count in enumerate(dispatcher.routed):
                routed.add_metric([self.model, str(i)], count)
            yield routed

    def _liveness(self):
        """Whether each core serves, and how many times it was restarted."""
        watch = getattr(self.client, "watch", None)
        if watch is None:
            return
        up = self._family(GaugeMetricFamily, "tidal:engine_core_up",
                          "1 while the engine core serves, 0 while down or restarting.",
                          labels=["core"])
        restarts = self._family(CounterMetricFamily, "tidal:engine_core_restarts",
                                "Engine-core processes started after one died.",
                                labels=["core"])
        for state in watch.cores:
            up.add_metric([self.model, str(state.index)], 1.0 if state.up else 0.0)
            restarts.add_metric([self.model, str(state.index)], state.restarts)
        yield up
        yield restarts


class ServerMetrics:
    """One registry per server (tests run several in one process). Per-request figures are
    vLLM's: observed as each prompt's sequences end (`RequestTally`)."""

    def __init__(self, client, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_CoreCollector(client, model_name))
        self.model = model_name

        def histogram(name: str, doc: str, buckets=_LATENCY):
            return Histogram(name, doc, ["model_name"], buckets=buckets,
                             registry=self.registry).labels(model_name)

        self.ttft = histogram("tidal:time_to_first_token_seconds", "Time to first token.")
        self.itl = histogram("tidal:inter_token_latency_seconds", "Time between tokens.")
        self.e2e = histogram("tidal:e2e_request_latency_seconds", "Request latency.", _REQUEST)
        self.queue = histogram("tidal:request_queue_time_seconds", "From a request's arrival "
                               "to its first admission.", _REQUEST)
        self.prefill = histogram("tidal:request_prefill_time_seconds", "From a request's "
                                 "admission to its first token.", _REQUEST)
        self.decode = histogram("tidal:request_decode_time_seconds", "From a request's first "
                                "token to its last.", _REQUEST)
        self.inference = histogram("tidal:request_inference_time_seconds", "From a "
                                   "request's admission to its last token.", _REQUEST)
        self.tpot = histogram("tidal:request_time_per_output_token_seconds", "A sequence's "
                              "decode time over its tokens after the first.")
        self.prompt_tokens = histogram("tidal:request_prompt_tokens", "A request's prompt "
                                       "tokens.", _TOKENS)
        self.generation_tokens = histogram("tidal:request_generation_tokens", "A request's "
                                           "generated tokens (all its n sequences).", _TOKENS)
        self.params_n = histogram("tidal:request_params_n", "A request's n.", _N)
        self.params_max_tokens = histogram("tidal:request_params_max_tokens", "A request's "
                                           "max_tokens (its limit where it set none).", _TOKENS)
        self._finished = Counter("tidal:request_success", "Finished requests by reason.",
                                 ["model_name", "finished_reason"], registry=self.registry)
        self._lora = Counter("tidal:lora_requests", "Requests by LoRA adapter.",
                             ["model_name", "lora_name"], registry=self.registry)
        # (finish time, TTFT, mean time per output token or None) of recent requests
        self.recent: deque[tuple[float, float, float | None]] = deque(maxlen=2048)

    def finished(self, reason: str):
        """The finished-requests counter of one reason."""
        return self._finished.labels(self.model, reason)

    def lora_request(self, adapter: str) -> None:
        """Count one request of a LoRA adapter."""
        self._lora.labels(self.model, adapter).inc()


class RequestTally:
    """One submission's latencies and sizes, per prompt (a request to vLLM, whose metrics
    these are): fed each update (`update`), each prompt observed once its n sequences end;
    `close` adds the submission to the dashboard's recent latencies."""

    def __init__(self, metrics: ServerMetrics, rids: list[str], prompt_lens: list[int],
                 n: int, max_tokens: int) -> None:
        self.metrics, self.n, self.max_tokens = metrics, n, max_tokens
        self.t0 = time.perf_counter()
        self.prompt_len = dict(zip(rids, prompt_lens))
        self.left = dict.fromkeys(rids, n)  # each prompt's sequences not finished
        self.first: dict[str, float] = {}  # each prompt's first token
        self.made: dict[str, int] = {}  # each prompt's tokens
        self.queue: dict[str, float] = {}  # each prompt's queue time (its index 0's)
        # each sequence's first and latest token, and its tokens
        self.seq_first: dict[str, float] = {}
        self.seq_last: dict[str, float] = {}
        self.seq_made: dict[str, int] = {}
        self.gaps: list[float] = []

    def update(self, u: StepUpdate, now: float) -> None:
        m, root, seq = self.metrics, u.root_id, u.request_id
        if u.new_token_ids:
            if root not in self.first:
                self.first[root] = now
                m.ttft.observe(now - self.t0)
            if seq in self.seq_last:
                self.gaps.append(now - self.seq_last[seq])
                m.itl.observe(self.gaps[-1])
            self.seq_first.setdefault(seq, now)
            self.seq_last[seq] = now
            self.seq_made[seq] = self.seq_made.get(seq, 0) + len(u.new_token_ids)
            self.made[root] = self.made.get(root, 0) + len(u.new_token_ids)
        if u.index == 0:
            self.queue.setdefault(root, u.queue_seconds)
        if not u.finished:
            return
        m.finished(u.finish_reason or "unknown").inc()
        made = self.seq_made.get(seq, 0)
        if made > 1:
            m.tpot.observe((self.seq_last[seq] - self.seq_first[seq]) / (made - 1))
        self.left[root] -= 1
        if not self.left[root]:
            self._request_done(root, now)

    def _request_done(self, root: str, now: float) -> None:
        m, prompt = self.metrics, self.prompt_len[root]
        m.e2e.observe(now - self.t0)
        m.prompt_tokens.observe(prompt)
        m.generation_tokens.observe(self.made.get(root, 0))
        m.params_n.observe(self.n)
        m.params_max_tokens.observe(self.max_tokens)
        if root in self.first:  # it made a token (else it ended before: nothing to time)
            ttft = self.first[root] - self.t0
            queue = min(self.queue.get(root, 0.0), ttft)
            m.queue.observe(queue)
            m.prefill.observe(ttft - queue)
            m.decode.observe(now - self.first[root])
            m.inference.observe(now - self.t0 - queue)

    def close(self) -> None:
        if self.first:  # for the dashboard's latency charts
            self.metrics.recent.append((time.time(), min(self.first.values()) - self.t0,
                                        sum(self.gaps) / len(self.gaps) if self.gaps else None))
