"""The base policy, first come first served; every policy derives from it."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Sequence

from tidal.core.request import Request

if TYPE_CHECKING:
    from tidal.core.config import SchedulerConfig
    from tidal.core.budget import StepPlan
    from tidal.core.scheduler import Scheduler


class Policy:
    """`fcfs`: the queue's own order (retracted requests rejoin its tail).

    A policy answers two questions per step: `order` (which waiting request is offered
    admission first) and `compose` (what the step holds, by calling the scheduler's
    `schedule_decodes` and `schedule_prefills` in the order and under the conditions it
    chooses)."""

    name = "fcfs"
    needs_step_time = False  # whether the scheduler must be given a StepTimeModel

    def __init__(self, config: "SchedulerConfig") -> None:
        self.batch_mode = config.batch_mode

    def order(self, waiting: Sequence[Request], step: int,
              prefix_tokens: Callable[[Request], int]) -> Sequence[Request]:
        """The waiting queue in admission order; admission stops at the first that does not
        fit (FIFO fairness), so the order decides who may overtake whom."""
        return waiting

    def compose(self, sched: "Scheduler", plan: "StepPlan", decoding: list[Request]) -> None:
        """`mixed` batches: decodes take their blocks first, then prefill chunks fill the
        budget, unless the decodes had to retract someone (memory is short: admit no one).
        `separate` batches: prefills, and decodes only in a step that holds no prefill."""
        if self.batch_mode == "mixed":
            sched.schedule_decodes(plan, decoding)
            if not plan.preempted:
                sched.schedule_prefills(plan, decoding)
        else:
            sched.schedule_prefills(plan, decoding)
            if not plan.out.scheduled:
                sched.schedule_decodes(plan, decoding)
