"""One simulated engine core: the real `tidal.core.Scheduler` whose executor is the cost
model, on a virtual clock. It also keeps each request's token times for the report."""

from __future__ import annotations

import random
from collections import deque
from dataclasses import replace
from itertools import compress
from operator import attrgetter

from tidal.core import (CacheConfig, KVCacheManager, ModelOutput, Request, RequestOutput,
                        Scheduler, SchedulerConfig, SchedulerOutput)
from tidal.core.snapshot import StepHistory
from tidal.core.step_time import StepShape
from tidal.sim.cost_model import CostModel

SIM_TOKEN = 7  # the token every simulated step "samples" (requests ignore EOS)
_ID, _SAMPLES = attrgetter("request_id"), attrgetter("samples")


class TokenClock:
    """Per request: first token, last token and the gaps between tokens (virtual seconds)."""

    __slots__ = ("first", "last", "itl", "count")

    def __init__(self) -> None:
        self.first = self.last = -1.0
        self.itl: list[float] = []
        self.count = 0

    def tick(self, now: float, tokens: int = 1) -> None:
        if tokens <= 0:
            return
        if self.count == 0:
            self.first = now
        else:
            self.itl.append(now - self.last)
        self.last = now
        self.count += tokens


class SimReplica:
    """An engine core whose forward pass is `cost.shape_time`. `start(now)` plans a step and
    returns when it ends; `finish()` applies the oldest step in flight, as the real core's
    update does. With pipeline stages and `batches_in_flight` > 1 (a P/D role holds one),
    steps overlap as stages of equal shares of each step: a step enters the first stage
    once it is free and each later one once the step left the stage before and the stage
    is free, so steps end in the order they started."""

    def __init__(self, sched: SchedulerConfig, cache: CacheConfig, cost: CostModel,
                 role: str = "mixed", spec_acceptance: float = 0.0, seed: int = 0) -> None:
        self.cost = cost
        # speculative decoding: a proposer that always holds the most guesses, each
        # accepted with this chance after the ones before it (a seeded draw per guess)
        self.guesses = sched.num_speculative_tokens if spec_acceptance else 0
        self.acceptance = spec_acceptance
        self.rng = random.Random(seed)
        self.now = 0.0  # the virtual clock, as of the step being planned
        # the roofline is the slo policy's step-time model: an oracle of this executor
        self.depth = sched.steps_in_flight if role == "mixed" else 1
        self.scheduler = Scheduler(replace(sched, role=role, batches_in_flight=self.depth),
                                   KVCacheManager(cache), step_time=cost,
                                   clock=lambda: self.now)
        # the steps in flight, oldest first: (plan, its tokens, when it ends)
        self.flight: deque[tuple[SchedulerOutput, int, float]] = deque()
        self.stage_free = [0.0] * cost.stages  # when each pipeline stage is next free
        self.steps = 0
        self.busy_seconds = 0.0  # summed step times
        self.outstanding = 0  # prompt + output tokens of the requests it holds (routing)
        self.pending_transfers: list[str] = []  # decode role: admitted, prefill not yet sent
        self.early: list[RequestOutput] = []  # finished by a step that computed nothing
        self.history: StepHistory | None = None  # steps, kept while a dashboard records
        self.generated = 0  # tokens sampled, counted while a dashboard records

    def add(self, request: Request) -> None:
        self.scheduler.add_request(request)
        self.outstanding += request.num_tokens + request.max_tokens

    def start(self, now: float) -> float | None:
        """Plan the next step; its end time, or None when there is nothing to compute now
        (a later arrival, KV transfer or step's end wakes the replica)."""
        sched = self.scheduler
        self.now = now
        for _ in range(3):  # a step that only retracts or admits KV transfers computes nothing
            if not sched.requests:  # has_unfinished_requests(), read directly: once a step
                return None
            out = sched.schedule()
            if out.transfer_ids:
                self.pending_transfers += out.transfer_ids
            if out.scheduled:
                shape = StepShape.of(out, sched.requests if sched.loras.seen else None)
                self.steps += 1
                took = self.cost.step_seconds(shape, self.rng.random)
                self.busy_seconds += took
                end = self._through_stages(now, took)
                self.flight.append((out, shape.tokens, end))
                if self.history is not None:
                    self.history.record(out, took, end, predicted=self.cost.shape_time(shape))
                return end
            if out.preempted_ids and self.flight:  # acknowledged after the steps before it
                end = max(now, self.flight[-1][2])
                self.flight.append((out, 0, end))
                return end
            self.early += sched.update(out, ModelOutput(preempted_ack=out.preempted_ids))
            if not (out.preempted_ids or out.transfer_ids):
                return None
        return None

    def _through_stages(self, now: float, took: float) -> float:
        """When a step of `took` seconds started now leaves the last stage."""
        share, end = took / len(self.stage_free), now
        for stage, free in enumerate(self.stage_free):
            end = (end if end > free else free) + share
            self.stage_free[stage] = end
        return end

    def finish(self) -> list[RequestOutput]:
        """Apply the oldest step in flight: every sampling request gets SIM_TOKEN."""
        out, tokens, _ = self.flight.popleft()
        # approximate: recomputed tokens count twice
        self.outstanding = max(0, self.outstanding - tokens)
        token = [SIM_TOKEN]  # one list for all: update() only reads it
        steps = out.scheduled
        if out.kind == "decode":  # every decode samples
            sampled = dict.fromkeys(map(_ID, steps), token)
        else:
            sampled = dict.fromkeys(compress(map(_ID, steps), map(_SAMPLES, steps)), token)
        result = ModelOutput(sampled, out.preempted_ids)
        if self.guesses:
            self._verify(out, result)
        if self.history is not None:
            self.generated += sum(map(len, sampled.values()))
        # The simulated executor has drained a preempted request's slot when its step ends.
        return self.scheduler.update(out, result)

    def _verify(self, out: SchedulerOutput, result: ModelOutput) -> None:
        """Each verification's accepted run (geometric), and guesses held for everyone
        where the plan asks for them."""
        rng, p = self.rng.random, self.acceptance
        for s in out.scheduled:
            if not s.is_prefill and s.num_new_tokens > 1:
                k = s.num_new_tokens - 1
                accepted = 0
                while accepted < k and rng() < p:
                    accepted += 1
                result.sampled[s.request_id] = [SIM_TOKEN] * (accepted + 1)
                result.drafted[s.request_id] = k
        if out.propose:
            result.proposed = dict.fromkeys(result.sampled, self.guesses)
