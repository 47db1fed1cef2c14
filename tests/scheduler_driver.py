"""A scheduler on a tiny pool with an executor that sees only the plans' plain data, driven
by plain operations (add, step, abort, KV hand-off, drain). The Hypothesis state machine draws
the operations; `benchmarks/scheduler_chaos.py` draws a million of them from a seeded RNG.
Every operation checks the invariants, that no token is appended twice and that the executor
knows every token a step computes."""

from __future__ import annotations

import math
import random
from collections import deque

from tidal.core import (CacheConfig, KVCacheManager, ModelOutput, Request, SamplingParams,
                        Scheduler, SchedulerConfig, StepShape)
from tidal.core.kv_tiers import KVTiers

EOS = 2
POLICIES = ["fcfs", "prefill_first", "priority", "longest_prefix_match", "slo"]
SLO_TARGETS = [None, 5.0, 50.0]  # ms, drawn for the slo policy's TTFT and TPOT defaults
STEP_SECONDS = 0.01  # the driver's clock advances this much per planned step


class LinearSteps:
    """A step-time model for the slo policy: 1 ms a step plus 0.1 ms a token."""

    def shape_time(self, shape: StepShape) -> float:
        return 1e-3 + 1e-4 * shape.tokens if shape.seqs else 0.0


class SchedulerDriver:
    """One scheduler and its fake executor; `steps_taken` counts plans, `tokens` the tokens
    the executor computed."""

    def __init__(self, num_blocks: int, block_size: int, role: str, batch_mode: str,
                 policy: str, async_scheduling: bool, chunk: int, max_input: int,
                 max_num_seqs: int, clip: int, margin: float, ttft: float | None = None,
                 tpot: float | None = None, overload: str = "defer", guesses: int = 0,
                 adaptive: bool = True, seed: int = 0, max_loras: int = 1,
                 lora_wait: int = 32, max_step_ms: float | None = None,
                 batches: int = 1, tier: int = 0) -> None:
        options = {  # each policy takes only its own options
            "longest_prefix_match": dict(lpm_aging_steps=8),
            "slo": dict(ttft_slo_ms=ttft, tpot_slo_ms=tpot, slo_overload=overload,
                        slo_max_defer_ms=100 * STEP_SECONDS * 1000)}.get(policy, {})
        cfg = SchedulerConfig.from_kwargs(
            chunked_prefill_size=max(chunk, block_size),
            max_input_tokens_per_step=max(max_input, block_size),
            batch_mode=batch_mode, policy=policy, role=role, async_scheduling=async_scheduling,
            max_num_seqs=max_num_seqs, clip_max_new_tokens=clip, safety_margin=margin,
            max_model_len=256, num_speculative_tokens=guesses, speculative_adaptive=adaptive,
            max_loras=max_loras, lora_wait_steps=lora_wait, max_step_ms=max_step_ms,
            batches_in_flight=batches, **options)
        # tier: a disk tier of that many blocks below the pool (one step in flight only,
        # as the engine allows), whose loads the executor fails now and then
        tiers = KVTiers(tier) if tier and batches == 1 else None
        self.s = Scheduler(cfg, KVCacheManager(CacheConfig(num_blocks, block_size), tiers),
                           step_time=LinearSteps(), clock=self.now)
        self.disk: set[bytes] = set()  # the keys the executor's tier stored
        self.scheduled: set[str] = set()  # every request id a step ever computed for
        self.inflight: deque = deque()
        # batches > 1: a pipeline's executor, which starts each step when planned (it must
        # know every token the step reads then) and completes them in order; requests
        # that finished while a step in flight held them are forgotten after it
        self.batches = batches
        self.forget_later: set[str] = set()
        self.known: dict[str, list[int]] = {}  # the executor's tokens, from plain data only
        self.num_samples: dict[str, int] = {}
        self.next_token = 10
        self.added = 0
        self.work = 0  # prompt + output tokens asked for: bounds the steps to drain
        self.steps_taken = self.tokens = 0
        self.cut = False  # cut the step run now short, where it is cuttable
        self.rng = random.Random(seed)  # how many guesses a proposer holds, and how many pass

    def now(self) -> float:
        return self.steps_taken * STEP_SECONDS

    @property
    def max_prompt(self) -> int:
        return min(40, self.s.kv.num_blocks * self.s.kv.block_size - 1)

    # ------------------------------------------------------------------ operations
    def add(self, prompt: list[int], n: int, max_tokens: int, ignore_eos: bool,
            priority: int, lora: str | None = None, background: bool = False) -> None:
        n = 1 if self.s.config.role == "decode" else n  # a decode instance forks nothing
        params = SamplingParams(max_tokens=max_tokens, n=n, ignore_eos=ignore_eos,
                                priority=priority, lora=lora, background=background)
        self.added += 1
        self.s.add_request(Request(f"r{self.added}", prompt, params, arrival_time=self.now(),
                                   eos_token_ids=(EOS,)))
        self.work += n * (len(prompt) + max_tokens)

    def step(self, emit_eos: bool, cut: bool = False) -> None:
        """Plan a step and run it (or the oldest in flight); `cut`: the executor cuts the
        step it runs short if it may (a live request arrived)."""
        self.cut = cut
        out = self.s.schedule()
        self.s.check_invariants()
        self._check_step_time(out)
        self.steps_taken += 1
        if self.batches == 1:
            self.inflight.append(out)
            if not self.s.config.async_scheduling or len(self.inflight) > 1:
                self._finish_oldest(emit_eos)
            return
        # as the engine core's pipelined loop: launch a plan with anything in it, complete
        # the oldest once the pipeline is full or nothing new started
        started = bool(out.scheduled or out.block_copies or out.new_requests
                       or out.finished_ids or out.preempted_ids)
        if started:
            self.inflight.append(out)
            self._launch(out)
        if self.inflight and (not started or len(self.inflight) >= self.batches):
            self._finish_oldest(emit_eos)

    def abort(self, rid: str) -> None:
        assert self.s.abort(rid)
        assert rid not in self.s.requests and rid not in self.s.kv.tables

    def transfers(self) -> list[str]:
        """The requests awaiting a P/D transfer (not a load from the tier)."""
        return sorted(rid for rid, r in self.s.transferring.items() if not r.tier_loading)

    def deliver(self, rid: str) -> None:
        """The KV transfer of `rid` completed (sent on a prefill role, arrived on decode)."""
        if self.s.config.role == "prefill":
            self.s.kv_sent(rid)
        else:
            self.s.kv_received(rid, self._token(False))
        self.s.check_invariants()

    def check_outputs(self) -> None:
        for r in self.s.requests.values():
            body = [t for t in r.output_token_ids if t != EOS]
            assert body == sorted(set(body)), f"{r}: a token was appended twice"

    def drain(self) -> None:
        """Step until every request finished (within a bound; a quarter of the steps that
        may be cut short are), then check nothing leaked."""
        s = self.s
        bound = 100 + 4 * self.work
        steps = 0
        while s.has_unfinished_requests():
            for rid in self.transfers():
                self.deliver(rid)
            self.step(emit_eos=False, cut=self.rng.random() < 0.25)
            steps += 1
            assert steps <= bound, f"no progress after {steps} steps: {s.stats()}"
        while self.inflight:
            self._finish_oldest(False)
        s.check_invariants()
        assert s.kv.num_free == s.kv.num_blocks  # nothing leaked
        last = s.schedule()  # the last finished ids reach the executor
        if self.batches > 1:
            self._launch(last)
        self._execute(last, False)
        assert self.known == {}, "the executor was never told these requests finished"
        self.work = 0

    # ------------------------------------------------------------------ executor
    def _finish_oldest(self, emit_eos: bool) -> None:
        out = self.inflight.popleft()
        self._execute(out, emit_eos)
        held = {x.request_id for step in self.inflight for x in step.scheduled}
        for rid in [r for r in self.forget_later if r not in held]:
            self.forget_later.discard(rid)
            self.known.pop(rid, None)
        for o in self.s.update(out, self.outputs):
            if o.finish_reason == "rejected":  # only before any compute, with no token
                assert o.request_id not in self.scheduled and not o.new_token_ids
        self.s.check_invariants()

    def _check_step_time(self, out) -> None:
        """Under a step target, a step computing more than one block of prompt tokens is
        predicted to keep within it (LinearSteps prices tokens alone: the sizer's estimate
        of a step is exact)."""
        prompt = sum(x.num_new_tokens for x in out.scheduled if x.is_prefill)
        if self.s.target.seconds < math.inf and prompt > self.s.block_size:
            seconds = LinearSteps().shape_time(StepShape.of(out))
            assert seconds <= self.s.target.seconds + 1e-12, (
                f"step {out.step}: {prompt} prompt tokens, predicted {seconds * 1e3:.2f} ms "
                f"over the {self.s.target.seconds * 1e3:g} ms target")

    def _launch(self, out) -> None:
        """A model runner starting a plan: forget finished requests (after the steps in
        flight that hold them), learn new ones; every token its entries read is known."""
        held = {x.request_id for step in list(self.inflight)[:-1] for x in step.scheduled}
        for rid in out.finished_ids:
            if rid in held:
                self.forget_later.add(rid)
            else:
                self.known.pop(rid, None)
        for new in out.new_requests:
            self.known[new.request_id] = new.prompt_token_ids + new.output_token_ids
            self.num_samples[new.request_id] = new.num_samples
        for x in out.scheduled:  # a decode reads its last token, a chunk its prompt's
            assert x.request_id in self.known, f"{x.request_id} started before it was known"
            read = x.num_computed_tokens + (x.num_new_tokens if x.is_prefill else 1)
            assert len(self.known[x.request_id]) >= read, (
                f"{x.request_id} started before its previous token returned")

    def _execute(self, out, emit_eos: bool) -> dict[str, list[int]]:
        """What a model runner does with a plan: forget finished requests, learn new ones
        (on starting it, for a pipeline's), read each entry's tokens, sample, keep its own
        samples."""
        s = self.s
        if self.batches == 1:
            for rid in out.finished_ids:
                self.known.pop(rid, None)
            for new in out.new_requests:
                self.known[new.request_id] = new.prompt_token_ids + new.output_token_ids
                self.num_samples[new.request_id] = new.num_samples
        if self.cut and out.cuttable and self.batches == 1 and not s.config.async_scheduling:
            self.outputs = ModelOutput(preempted_ack=list(out.preempted_ids), cut=True)
            return {}  # stopped between layers, as the engine may: nothing sampled
        sampled, drafted, proposed = {}, {}, {}
        loaded = self._tier_io(out)
        failed = {x.request_id for x in out.kv_loads  # left out of the forward pass
                  if x.inline and loaded[x.request_id] < len(x.keys)}
        for x in out.scheduled:
            rid, c, n = x.request_id, x.num_computed_tokens, x.num_new_tokens
            if rid in failed:
                continue
            assert len(x.block_ids) * s.kv.block_size >= c + n
            assert rid in self.known, f"{rid} scheduled before the executor was told of it"
            assert x.is_prefill or n - 1 <= s.config.num_speculative_tokens
            self.scheduled.add(rid)
            self.tokens += n
            r = s.requests.get(rid)
            if r is not None and r.status.name == "RUNNING" and r.num_tokens >= c + n:
                assert self.known[rid][c:c + n] == r.token_slice(c, c + n)
            if not x.samples:
                continue
            if not x.is_prefill and n > 1:  # verify the guesses: some pass, then one more
                drafted[rid] = self.rng.randint(0, n - 1)
                count = 1 + self.rng.randint(0, drafted[rid])
                sampled[rid] = [self._token(emit_eos) for _ in range(count)]
                self.known[rid] += sampled[rid]
            else:
                sampled[rid] = [self._token(emit_eos) for _ in range(self.num_samples[rid])]
                self.known[rid].append(sampled[rid][0])
            self.num_samples[rid] = 1
            if out.propose:
                proposed[rid] = self.rng.randint(0, s.config.num_speculative_tokens)
        self.outputs = ModelOutput(sampled=sampled, drafted=drafted, proposed=proposed,
                                   preempted_ack=list(out.preempted_ids), kv_loaded=loaded)
        return sampled

    def _tier_io(self, out) -> dict[str, int]:
        """The tier's stores, then its loads: a block loads whole only if stored before
        (and not failing now and then); no forward pass of the step reads a block loading
        beside it, and one loading inline is read by its own request alone."""
        self.disk.update(key for _, key in out.kv_stores)
        bs = self.s.kv.block_size  # tables grow in place: a step's share is their head
        reads = {x.request_id: set(x.block_ids[:-(-(x.num_computed_tokens + x.num_new_tokens)
                                                  // bs)]) for x in out.scheduled}
        loaded = {}
        for load in out.kv_loads:
            readers = {rid for rid, read in reads.items() if read & set(load.block_ids)}
            assert readers <= ({load.request_id} if load.inline else set()), \
                "a step reads blocks it is loading beside it, or another's inline load"
            if load.inline:
                assert load.request_id in readers, "an inline load its request does not read"
            whole = next((i for i, key in enumerate(load.keys) if key not in self.disk),
                         len(load.keys))
            loaded[load.request_id] = min(whole, self.rng.choice(
                [whole, whole, self.rng.randint(0, whole)]))
        return loaded

    def _token(self, emit_eos: bool) -> int:
        if emit_eos:
            return EOS
        self.next_token += 1  # increasing, so a token appended twice would show
        return self.next_token
