"""`prefill_first`: finish a chunked prefill before decoding again."""

from __future__ import annotations

from tidal.core.policies.base import Policy


class PrefillFirst(Policy):
    """FCFS order; in `mixed` batches no decode runs while the chunked prefill moves. A
    stalled one (no memory) does not hold the decodes, which may free memory for it."""

    name = "prefill_first"

    def compose(self, sched, plan, decoding):
        if self.batch_mode != "mixed":
            return super().compose(sched, plan, decoding)
        sched.schedule_prefills(plan, decoding)
        if sched.active_prefill is None or not plan.num_prefills:
            sched.schedule_decodes(plan, decoding)
