"""Steps cut short for live requests. On a CPU a step that computes a background request's
prompt chunk (a Batch API line's) takes a hundred milliseconds or more, and a live request
arriving meanwhile would wait for all of it. A plan whose one prompt chunk is a background
request's, its other rows one-token decodes, is `cuttable`: the executor may stop it
between two layers once a live request has arrived (`ModelOutput.cut`), and `undo_step`
puts its requests back where the plan found them; the next plan computes the live prompt
(beside the live decodes). Nothing of the cut step is kept: its rows write their KV again
when they run again, no block was cached from it (blocks are cached as steps complete),
and no token was sampled."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tidal.core.outputs import SchedulerOutput
from tidal.core.request import RequestStatus

if TYPE_CHECKING:
    from tidal.core.scheduler import Scheduler


def cuttable(sched: "Scheduler", out: SchedulerOutput) -> bool:
    """Whether the executor may cut `out` short (`cut_background_steps`): it computes one
    prompt chunk, a background request's (a step of decodes alone is short; a live prompt
    is what a cut makes room for), its other rows are one-token decodes, and it moves no
    blocks (copies and tier loads happen once)."""
    if (out.kind not in ("prefill", "mixed") or not sched.config.cut_background_steps
            or out.block_copies or out.kv_loads or out.kv_stores or out.transfer_ids):
        return False  # decodes alone (the hot path at large batches) end here
    prefills = 0
    for s in out.scheduled:
        if s.is_prefill:
            r = sched.requests.get(s.request_id)
            if r is None or not r.sampling_params.background:
                return False
            prefills += 1
        elif s.num_new_tokens != 1:  # a verification of guesses
            return False
    return prefills == 1 and not sched.role.concurrent_prefills


def undo_step(sched: "Scheduler", out: SchedulerOutput) -> None:
    """After a cut: each request's tokens of the step are to compute again. Blocks the
    plan allocated stay with their requests; the one prompt chunk's request is the partial
    prefill again (its chunk may have ended its prompt, or its whole prompt fit)."""
    sched.num_steps_cut += 1
    for s in out.scheduled:
        r = sched.requests.get(s.request_id)
        if r is None:
            continue  # aborted meanwhile: its blocks are free already
        r.num_in_flight -= s.samples
        if r.status is RequestStatus.RUNNING:
            r.num_computed_tokens = s.num_computed_tokens
            if s.is_prefill:
                sched.active_prefill = r
