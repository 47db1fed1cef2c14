"""Hypothesis state machine: random arrivals, steps, aborts, forks, KV hand-offs and prefix
cache resets on tiny pools, in every role, batch mode, policy and executor mode, with requests of several LoRA
adapters and steps of background work cut short now and then. After every rule the
invariants hold; at the end every request finishes within a bounded number of steps. The
executor sees only the plans' plain data, as the model runner does: it must always know the
tokens a step computes (`scheduler_driver.py`)."""

from __future__ import annotations

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from scheduler_driver import POLICIES, SLO_TARGETS, SchedulerDriver


class SchedulerMachine(RuleBasedStateMachine):
    @initialize(
        num_blocks=st.integers(4, 64),
        block_size=st.sampled_from([2, 3, 4, 8, 16]),
        role=st.sampled_from(["mixed", "mixed", "prefill", "decode"]),
        batch_mode=st.sampled_from(["separate", "mixed"]),
        policy=st.sampled_from(POLICIES),
        async_scheduling=st.booleans(),
        chunk=st.integers(1, 64),
        max_input=st.integers(1, 96),
        max_num_seqs=st.integers(1, 8),
        clip=st.sampled_from([1, 8, 4096]),
        margin=st.sampled_from([0.0, 0.0, 0.25]),
        ttft=st.sampled_from(SLO_TARGETS),
        tpot=st.sampled_from(SLO_TARGETS),
        overload=st.sampled_from(["defer", "reject"]),
        guesses=st.sampled_from([0, 0, 1, 3]),
        adaptive=st.booleans(),
        seed=st.integers(0, 3),
        max_loras=st.integers(1, 3),
        lora_wait=st.sampled_from([0, 2, 32]),
        max_step_ms=st.sampled_from([None, None, 3.0, 6.0]),  # 20 and 50 tokens a step
        batches=st.sampled_from([1, 1, 2, 3]),  # steps in flight: pipeline stages
        tier=st.sampled_from([0, 0, 4, 64]),  # blocks of the disk tier below the pool
    )
    def setup(self, **config):
        self.d = SchedulerDriver(**config)

    @rule(data=st.data())
    def add_request(self, data):
        d = self.d
        d.add(prompt=data.draw(st.lists(st.integers(3, 5), min_size=1, max_size=d.max_prompt)),
              n=data.draw(st.integers(1, 3)), max_tokens=data.draw(st.integers(1, 12)),
              ignore_eos=data.draw(st.booleans()), priority=data.draw(st.integers(-2, 2)),
              lora=data.draw(st.sampled_from([None, None, "a", "b", "c", "d"])),
              background=data.draw(st.booleans()))

    @rule(eos=st.integers(0, 9), cut=st.booleans())
    def step(self, eos, cut):
        self.d.step(emit_eos=eos == 0, cut=cut)

    @precondition(lambda self: bool(self.d.s.requests))
    @rule(data=st.data())
    def abort(self, data):
        self.d.abort(data.draw(st.sampled_from(sorted(self.d.s.requests))))

    @rule()
    def reset_prefix_cache(self):  # in the middle of anything: the invariants still hold
        self.d.s.kv.reset_prefix_cache()
        self.d.s.check_invariants()

    @precondition(lambda self: bool(self.d.transfers()))
    @rule(data=st.data())
    def kv_transfer_done(self, data):
        self.d.deliver(data.draw(st.sampled_from(self.d.transfers())))

    @precondition(lambda self: hasattr(self, "d"))
    @invariant()
    def outputs_never_repeat(self):
        self.d.check_outputs()

    def teardown(self):
        if hasattr(self, "d"):
            self.d.drain()


TestScheduler = SchedulerMachine.TestCase
