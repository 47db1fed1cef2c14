"""Hypothesis state machine: random arrivals, steps, aborts, forks and KV hand-offs on tiny
pools, in every role, batch mode, policy and executor mode. After every rule the invariants
hold; at the end every request finishes within a bounded number of steps. The executor sees
only the plans' plain data, as the model runner does: it must always know the tokens a step
computes."""

from __future__ import annotations

from collections import deque

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from tidal.core import (CacheConfig, KVCacheManager, ModelOutput, Request, SamplingParams,
                        Scheduler, SchedulerConfig)

EOS = 2


class SchedulerMachine(RuleBasedStateMachine):
    @initialize(
        num_blocks=st.integers(4, 64),
        block_size=st.sampled_from([2, 3, 4, 8, 16]),
        role=st.sampled_from(["mixed", "mixed", "prefill", "decode"]),
        batch_mode=st.sampled_from(["separate", "mixed"]),
        policy=st.sampled_from(["fcfs", "prefill_first", "priority", "longest_prefix_match"]),
        async_scheduling=st.booleans(),
        chunk=st.integers(1, 64),
        max_input=st.integers(1, 96),
        max_num_seqs=st.integers(1, 8),
        clip=st.sampled_from([1, 8, 4096]),
        margin=st.sampled_from([0.0, 0.0, 0.25]),
    )
    def setup(self, num_blocks, block_size, role, batch_mode, policy, async_scheduling, chunk,
              max_input, max_num_seqs, clip, margin):
        cfg = SchedulerConfig(
            chunked_prefill_size=max(chunk, block_size),
            max_input_tokens_per_step=max(max_input, block_size),
            batch_mode=batch_mode, policy=policy, role=role, async_scheduling=async_scheduling,
            max_num_seqs=max_num_seqs, clip_max_new_tokens=clip, safety_margin=margin,
            lpm_aging_steps=8, max_model_len=256)
        self.s = Scheduler(cfg, KVCacheManager(CacheConfig(num_blocks, block_size)))
        self.inflight: deque = deque()
        self.known: dict[str, list[int]] = {}  # the executor's tokens, from plain data only
        self.num_samples: dict[str, int] = {}
        self.next_token = 10
        self.added = 0
        self.work = 0  # prompt + output tokens asked for: bounds the steps to drain

    # ------------------------------------------------------------------ rules
    @rule(data=st.data())
    def add_request(self, data):
        s = self.s
        cap = min(40, s.kv.num_blocks * s.kv.block_size - 1)
        prompt = data.draw(st.lists(st.integers(3, 5), min_size=1, max_size=cap))
        n = 1 if s.config.role == "decode" else data.draw(st.integers(1, 3))
        params = SamplingParams(max_tokens=data.draw(st.integers(1, 12)), n=n,
                                ignore_eos=data.draw(st.booleans()),
                                priority=data.draw(st.integers(-2, 2)))
        self.added += 1
        s.add_request(Request(f"r{self.added}", prompt, params, arrival_time=self.added,
                              eos_token_id=EOS))
        self.work += n * (len(prompt) + params.max_tokens)

    @rule(eos=st.integers(0, 9))
    def step(self, eos):
        self.inflight.append(self.s.schedule())
        self.s.check_invariants()
        if not self.s.config.async_scheduling or len(self.inflight) > 1:
            self._finish_oldest(eos == 0)

    @precondition(lambda self: bool(self.s.requests))
    @rule(data=st.data())
    def abort(self, data):
        rid = data.draw(st.sampled_from(sorted(self.s.requests)))
        assert self.s.abort(rid)
        assert rid not in self.s.requests and rid not in self.s.kv.tables

    @precondition(lambda self: bool(self.s.transferring))
    @rule(data=st.data())
    def kv_transfer_done(self, data):
        rid = data.draw(st.sampled_from(sorted(self.s.transferring)))
        self._deliver(rid)

    # ------------------------------------------------------------------ executor
    def _finish_oldest(self, emit_eos: bool) -> None:
        out = self.inflight.popleft()
        s = self.s
        sampled = self._execute(out, emit_eos)
        s.update(out, ModelOutput(sampled=sampled, preempted_ack=list(out.preempted_ids)))
        s.check_invariants()

    def _execute(self, out, emit_eos: bool) -> dict[str, list[int]]:
        """What a model runner does with a plan: forget finished requests, learn new ones,
        read each entry's tokens, sample, keep its own samples."""
        s = self.s
        for rid in out.finished_ids:
            self.known.pop(rid, None)
        for new in out.new_requests:
            self.known[new.request_id] = new.prompt_token_ids + new.output_token_ids
            self.num_samples[new.request_id] = new.num_samples
        sampled = {}
        for x in out.scheduled:
            rid, c, n = x.request_id, x.num_computed_tokens, x.num_new_tokens
            assert len(x.block_ids) * s.kv.block_size >= c + n
            assert rid in self.known, f"{rid} scheduled before the executor was told of it"
            assert x.is_prefill or n == 1
            r = s.requests.get(rid)
            if r is not None and r.status.name == "RUNNING" and r.num_tokens >= c + n:
                assert self.known[rid][c:c + n] == r.token_slice(c, c + n)
            if x.samples:
                sampled[rid] = [self._token(emit_eos) for _ in range(self.num_samples[rid])]
                self.known[rid].append(sampled[rid][0])
                self.num_samples[rid] = 1
        return sampled

    def _token(self, emit_eos: bool) -> int:
        if emit_eos:
            return EOS
        self.next_token += 1  # increasing, so a token appended twice would show
        return self.next_token

    def _deliver(self, rid: str) -> None:
        if self.s.config.role == "prefill":
            self.s.kv_sent(rid)
        else:
            self.s.kv_received(rid, self._token(False))
        self.s.check_invariants()

    @precondition(lambda self: hasattr(self, "s"))
    @invariant()
    def outputs_never_repeat(self):
        for r in self.s.requests.values():
            body = [t for t in r.output_token_ids if t != EOS]
            assert body == sorted(set(body)), f"{r}: a token was appended twice"

    def teardown(self):
        if not hasattr(self, "s"):
            return
        s = self.s
        bound = 100 + 4 * self.work
        steps = 0
        while s.has_unfinished_requests():
            for rid in sorted(s.transferring):
                self._deliver(rid)
            self.step(eos=1)
            steps += 1
            assert steps <= bound, f"no progress after {steps} steps: {s.stats()}"
        while self.inflight:
            self._finish_oldest(False)
        s.check_invariants()
        assert s.kv.num_free == s.kv.num_blocks  # nothing leaked
        self._execute(s.schedule(), False)  # the last finished ids reach the executor
        assert self.known == {}, "the executor was never told these requests finished"


TestScheduler = SchedulerMachine.TestCase
