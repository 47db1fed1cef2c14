"""n>1 requests: once the prompt is computed, the siblings fork off the parent."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tidal.core.outputs import RequestOutput
from tidal.core.request import Request, RequestStatus

if TYPE_CHECKING:
    from tidal.core.scheduler import Scheduler


def fork_siblings(sched: "Scheduler", parent: Request, tokens: list[int],
                  ) -> list[RequestOutput]:
    """The parent's siblings, one per first token of `tokens`: each shares the prompt's full
    blocks and copies its partial last block (a copy the next step makes). A sibling that
    finds no free block recomputes its prompt from the waiting queue."""
    parent.fork_pending = False
    outputs = []
    for index, token in enumerate(tokens, start=1):
        child = parent.fork(index)
        sched.requests[child.request_id] = child
        copies = sched.kv.fork(parent, child, parent.prefill_target)
        if copies is None:
            child.enqueue_step = sched.step
            sched.waiting.append(child)
        else:
            sched._pending_copies.extend(copies)
            child.num_computed_tokens = child.prefill_target = parent.prefill_target
            child.status = RequestStatus.RUNNING
            sched.running.append(child)
            sched._pending_new.append(child)  # its first step is a decode
        outputs.append(sched._append(child, token))
    return outputs
