"""The base policy, first come first served; every policy derives from it."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, ClassVar, Sequence

from tidal.core.request import Request
from tidal.core.step_sizing import cap_prefill, decode_shape, lone_prompt_target

if TYPE_CHECKING:
    from tidal.core.config import SchedulerConfig
    from tidal.core.budget import StepPlan
    from tidal.core.scheduler import Scheduler


class Policy:
    """`fcfs`: the queue's own order (retracted requests rejoin its tail).

    A policy answers three questions per step: `size_step` (how many prompt tokens the step
    may compute), `order` (which waiting request is offered admission first) and `compose`
    (what the step holds, by calling the scheduler's `schedule_decodes` and
    `schedule_prefills` in the order and under the conditions it chooses).

    A policy declares its own options (`Options`, a frozen dataclass of `knob` fields: each
    one an engine option, flag and `LLM` keyword of the same name) and what it can do, for
    the layers above the core to ask rather than compare policy names:
    `takes_latency_targets`, `may_reject` and `latency_targets`."""

    @dataclass(frozen=True)
    class Options:
        """A policy's options; the base policy has none."""

    name: ClassVar[str] = "fcfs"
    needs_step_time: ClassVar[bool] = False  # whether the scheduler must get a StepTimeModel
    # Whether requests' own ttft_slo_ms / tpot_slo_ms mean anything to it (else a 400).
    takes_latency_targets: ClassVar[bool] = False

    def __init__(self, config: "SchedulerConfig") -> None:
        self.batch_mode = config.batch_mode
        self.options = config.policy_options

    @classmethod
    def may_reject(cls, options: "Policy.Options") -> bool:
        """Whether, with these options, it may finish a waiting request before any compute
        (finish_reason "rejected"): a server then holds a stream's headers until its first
        token, so that a rejection is a plain 503."""
        return False

    @classmethod
    def latency_targets(cls, options: "Policy.Options") -> tuple[float | None, float | None]:
        """(TTFT ms, TPOT ms) that requests setting none are held to; None: no target."""
        return None, None

    def tpot(self, r: Request) -> float | None:
        """The request's time-per-output-token target in seconds; None: it has none."""
        return None

    def order(self, waiting: Sequence[Request], step: int,
              prefix_tokens: Callable[[Request], int]) -> Sequence[Request]:
        """The waiting queue in admission order; admission stops at the first that does not
        fit (FIFO fairness), so the order decides who may overtake whom."""
        return waiting

    def size_step(self, sched: "Scheduler", plan: "StepPlan", decoding: list[Request]) -> None:
        """Before the step is composed, when prompts are to compute: cap its prefill tokens
        so that it is predicted to take at most the scheduler's step target (a share of it
        when every prompt to compute is a background request's: a live request arriving
        meanwhile waits for the step in progress; more for a live prompt alone, whose chunks
        keep no one waiting: `lone_prompt_target`)."""
        target = sched.target.seconds
        if target < math.inf:
            if not _live_prompt(sched):  # background prompts only
                target *= sched.config.background_step_share
            else:
                target = lone_prompt_target(sched, decoding, target)
            cap_prefill(sched, plan, decode_shape(decoding), target)

    def compose(self, sched: "Scheduler", plan: "StepPlan", decoding: list[Request]) -> None:
        """`mixed` batches: decodes take their blocks first, then prefill chunks fill the
        budget, unless the decodes had to retract someone (memory is short: admit no one).
        While a live request's prompt waits or prefills beside background work, prefills
        come first and only live prompts join the step: a background prompt's partial
        prefill gives way to a waiting live one (`yield_to_live`), and background decodes
        sit out a step that holds a prefill.
        `separate` batches: prefills, and decodes only in a step that holds no prefill."""
        if self.batch_mode == "mixed" and _yielding(sched, decoding):
            yield_to_live(sched, plan)
            plan.live_only = True
            sched.schedule_prefills(plan, decoding)
            sched.schedule_decodes(plan, [r for r in decoding if not r.sampling_params.background]
                                   if plan.num_prefills else decoding)
        elif self.batch_mode == "mixed":
            sched.schedule_decodes(plan, decoding)
            if not plan.preempted:
                sched.schedule_prefills(plan, decoding)
        else:
            sched.schedule_prefills(plan, decoding)
            if not plan.out.scheduled:
                sched.schedule_decodes(plan, decoding)


def foreground_first(ordered: Sequence[Request], live_only: bool = False) -> list[Request]:
    """A policy's admission order with background requests after the rest (or left out)."""
    live = [r for r in ordered if not r.sampling_params.background]
    return live if live_only else live + [r for r in ordered if r.sampling_params.background]


def yield_to_live(sched: "Scheduler", plan: "StepPlan") -> None:
    """Retract a background request's partial prefill while a live request waits, so that
    the live prompt may take the step's budget and the one chunked-prefill slot. Only where
    the prefix cache keeps the background request's computed blocks (it resumes from them,
    recomputing at most its last partial block), so that it always moves forward."""
    r = sched.active_prefill
    if (r is not None and r.sampling_params.background and sched.kv.keeps_prefix(r)
            and any(not w.sampling_params.background for w in sched.waiting)):
        sched.retract(plan, r)


def _live_prompt(sched: "Scheduler") -> bool:
    """Whether a request that is not background waits or prefills."""
    return (any(not r.sampling_params.background for r in sched.waiting)
            or any(not r.sampling_params.background and r.is_prefilling
                   for r in sched.running))


def _yielding(sched: "Scheduler", decoding: list[Request]) -> bool:
    """Whether background work (decodes, a partial prefill, waiting prompts) is there while
    a live request's prompt waits or prefills."""
    return ((any(r.sampling_params.background for r in decoding)
             or any(r.sampling_params.background for r in sched.waiting)
             or (sched.active_prefill is not None
                 and sched.active_prefill.sampling_params.background))
            and _live_prompt(sched))
