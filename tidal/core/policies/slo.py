"""`slo`: as many requests within their latency targets as the hardware allows."""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tidal.core.knobs import check_choice, check_positive, knob
from tidal.core.policies.base import Policy
from tidal.core.request import Request
from tidal.core.step_sizing import cap_prefill, decode_shape, largest, prompt_step
from tidal.core.step_time import StepShape

if TYPE_CHECKING:
    from tidal.core.budget import StepPlan
    from tidal.core.scheduler import Scheduler

SLO_OVERLOAD = ("defer", "reject")


class SloPolicy(Policy):
    """Each request has a TTFT deadline (arrival + `ttft_slo_ms`) and a TPOT target (its own,
    else the scheduler's defaults; either may be absent). With the scheduler's step-time
    model, every step with prompts to compute runs two named pieces, then the step:

    - `size_step`: the prefill tokens the step may add so that its predicted time stays
      within the tightest TPOT target of the running decodes and the scheduler's
      `max_step_ms` (at least one block, so prompts always move), and the most requests
      that may run at once so that their decode step still leaves room for that block;
    - `triage`: the waiting queue's admission order. Retracted requests come first (one
      admitted is never rejected), then those waiting past `slo_max_defer_ms` (the starvation bound),
      then, by deadline, those predicted to make it (Moore-Hodgson over predicted prefill
      times: whenever the next one would be late, the longest job so far gives way, which
      keeps the most requests on time), then those without a TTFT target, then the ones
      that would be late: deferred, or under `slo_overload='reject'` rejected at once;
    - the step itself, composed as `fcfs` does (decodes first, then prefills in that order).
    """

    @dataclass(frozen=True)
    class Options(Policy.Options):
        """The latency targets of requests that set none, and what happens to a request
        predicted to miss its TTFT target."""

        ttft_slo_ms: float | None = knob(
            None, "The time-to-first-token target (ms, from arrival) of requests that set "
            "none; None: no TTFT target.")
        tpot_slo_ms: float | None = knob(
            None, "The time-per-output-token target (ms) of requests that set none; None: no "
            "TPOT target.")
        slo_overload: str = knob(
            "defer", "For a waiting request predicted to miss its TTFT target: 'defer' "
            "(behind every request that can still meet its own) or 'reject' (finish it "
            "before any compute: the server answers 503).")
        slo_max_defer_ms: float = knob(
            30000.0, "A request waiting this long (ms, from arrival) goes ahead of every "
            "request that has not, so a deferred one is served within a bounded time.")
        slo_step_headroom: float = knob(
            0.85, "Steps are sized to this share of the tightest TPOT target: a step runs "
            "slower than predicted now and then, and a request whose steps all sit at its "
            "target misses it on half of them.")

        def __post_init__(self) -> None:
            check_choice("slo_overload", self.slo_overload, SLO_OVERLOAD)
            check_positive(self, "ttft_slo_ms", "tpot_slo_ms", "slo_max_defer_ms")
            if not 0 < self.slo_step_headroom <= 1:
                raise ValueError("slo_step_headroom must be in (0, 1]")

    name = "slo"
    needs_step_time = True
    takes_latency_targets = True

    def __init__(self, config) -> None:
        super().__init__(config)
        self._order: list[Request] = []

    @classmethod
    def may_reject(cls, options: "SloPolicy.Options") -> bool:
        return options.slo_overload == "reject"

    @classmethod
    def latency_targets(cls, options: "SloPolicy.Options") -> tuple[float | None, float | None]:
        return options.ttft_slo_ms, options.tpot_slo_ms

    def order(self, waiting, step, prefix_tokens):
        return self._order  # triage() ran on this very queue at the start of the step

    def size_step(self, sched: "Scheduler", plan: "StepPlan", decoding: list[Request]) -> None:
        # Runs only when prompts are to compute: a step of decodes alone (the common one
        # under load) skips sizing and triage.
        self._order = []
        rate = self._size(sched, plan, decoding)
        if sched.waiting:
            self._order = self.triage(sched, rate)

    # ------------------------------------------------------------------ targets
    def ttft_ms(self, r: Request) -> float | None:
        return r.sampling_params.ttft_slo_ms or self.options.ttft_slo_ms

    def deadline(self, r: Request) -> float | None:
        ms = self.ttft_ms(r)
        return None if ms is None else r.arrival_time + ms / 1000

    def tpot(self, r: Request) -> float | None:
        ms = r.sampling_params.tpot_slo_ms or self.options.tpot_slo_ms
        return None if ms is None else ms / 1000

    # ------------------------------------------------------------------ step sizing
    def _size(self, sched: "Scheduler", plan: "StepPlan", decoding: list[Request]) -> float:
        """Cap the step's prefill tokens by the tightest TPOT target of the running decodes
        (and the step-time target, `max_step_ms`), and the requests that may run at once by
        that TPOT target; returns the prefill rate (tokens/s) such steps reach."""
        model, bs, budget = sched.step_time, sched.block_size, plan.budget
        decode, tpot = decode_shape(decoding), math.inf
        for r in decoding:
            t = self.tpot(r)
            if t is not None and t < tpot:
                tpot = t
        tpot *= self.options.slo_step_headroom
        room = tokens = min(budget.rem_input_tokens, budget.rem_chunk_tokens)
        mean = decode.kv_tokens // max(1, decode.seqs)  # about the mean context
        if model.shape_time(StepShape().add(1, mean).add(bs, 0)) > tpot:
            tpot = math.inf  # not even one decode beside a block meets it: no use capping
        target = min(tpot, sched.target.seconds)
        if target < math.inf:
            tokens = cap_prefill(sched, plan, decode, target)
        if tpot < math.inf and room > bs:
            plan.max_seqs = min(plan.max_seqs, self._max_seqs(sched, decode, mean, tpot))
        if tokens <= 0:
            return math.inf
        seconds = prompt_step(sched, decode)(tokens)
        return tokens / seconds if seconds > 0 else math.inf

    def _max_seqs(self, sched: "Scheduler", decode: StepShape, mean: int, target: float) -> int:
        """Requests that may hold blocks: the running and arriving ones, plus as many new
        ones (at the running decodes' `mean` context) as keep a decode step with one block
        of prefill beside it within `target` (none while the running ones already take it;
        they finish and make room)."""
        held = len(sched.running) + len(sched.transferring)
        base = decode.copy()
        for r in sched.running:
            if r.is_prefilling:  # decodes soon
                base.add(1, r.prefill_target)
        bs, model = sched.block_size, sched.step_time
        spare = sched.config.max_num_seqs - held
        if spare <= 0:
            return held

        def fits(k: int) -> bool:
            return model.shape_time(base.copy().add(1, mean, count=k).add(bs, 0)) <= target

        return held + (largest(1, spare, fits) if fits(1) else 0)

    # ------------------------------------------------------------------ admission order
    def triage(self, sched: "Scheduler", rate: float) -> list[Request]:
        """The waiting queue in admission order; rejects the late ones under 'reject'."""
        now, max_defer = sched.clock(), self.options.slo_max_defer_ms / 1000
        resumed, aged, untimed, timed = [], [], [], []
        for r in sched.waiting:
            if r.admitted or r.output_token_ids:  # retracted (or a forked sibling): resume
                resumed.append(r)
            elif now - r.arrival_time >= max_defer:
                aged.append(r)
            elif (deadline := self.deadline(r)) is None:
                untimed.append(r)
            else:
                timed.append((deadline, r))
        timed.sort(key=_first)  # stable: arrival order among equal deadlines
        # Prefill work ahead of the timed requests: running prompts, resumed and aged ones.
        late = _moore_hodgson(timed, now + sched.prefill_backlog(resumed + aged) / rate, rate)
        on_time = [r for i, (_, r) in enumerate(timed) if i not in late]
        behind = [r for i, (_, r) in enumerate(timed) if i in late]
        if behind and self.may_reject(self.options):
            for r in behind:
                sched.reject(r, f"the server is overloaded: this request would miss its "
                                f"time-to-first-token target of {self.ttft_ms(r):g} ms; "
                                "retry later")
            behind = []
        return resumed + aged + on_time + untimed + behind


def _first(pair: tuple) -> float:
    return pair[0]


def _moore_hodgson(timed: list[tuple[float, Request]], start: float, rate: float) -> set[int]:
    """Indices of the requests (sorted by deadline) that one prefill server starting at
    `start` and computing `rate` tokens/s cannot finish in time, fewest possible: add each
    in deadline order; when the newest would finish late, drop the longest so far."""
    t, heap, late = start, [], set()
    for i, (deadline, r) in enumerate(timed):
        p = 0.0 if r.remote_prefill else r.num_tokens / rate  # remote: KV arrives, no compute
        heapq.heappush(heap, (-p, i))
        t += p
        if t > deadline:
            neg, j = heapq.heappop(heap)
            t += neg
            late.add(j)
    return late
