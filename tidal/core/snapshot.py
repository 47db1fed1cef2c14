"""What the live dashboard shows of a scheduler: its queues request by request, the KV pool
block by block, and its recent steps. Plain data (dataclasses msgspec and json encode), built
on demand: a scheduler that nobody watches builds none of it.
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tidal.core.outputs import SchedulerOutput
    from tidal.core.scheduler import Scheduler

# One character a block cell: free (never cached), cached (free, holds a reusable prefix:
# evictable), used by one request, shared by several (prefix hits).
FREE, CACHED, USED, SHARED = ".", "c", "u", "s"
_RANK = {FREE: 0, CACHED: 1, USED: 2, SHARED: 3}
_BY_RANK = FREE + CACHED + USED + SHARED


@dataclass
class RequestView:
    """One request as the dashboard lists it."""

    id: str
    state: str  # waiting, prefill, decode, preempted, transferring
    age: float  # seconds since arrival, on the scheduler's clock
    prompt_tokens: int
    output_tokens: int
    computed_tokens: int  # positions whose KV is written


@dataclass
class StepRecord:
    """One executed step: when it ended, its prompt and decode tokens (guesses included),
    its seconds, the guesses it accepted, and the seconds the step-time model predicted
    (0: no model)."""

    time: float
    prefill_tokens: int
    decode_tokens: int
    seconds: float
    accepted_tokens: int = 0
    predicted: float = 0.0


class StepHistory:
    """The last `size` steps, appended by whoever executes them (thread-safe appends)."""

    def __init__(self, size: int = 512) -> None:
        self.steps: deque[StepRecord] = deque(maxlen=size)
        self.prefill_total = self.decode_total = 0  # tokens of every step recorded

    def record(self, out: "SchedulerOutput", seconds: float, now: float,
               prefill: int | None = None, accepted: int = 0, predicted: float = 0.0) -> None:
        """Add a step; `prefill`: its prompt tokens, where the caller counted them already;
        `accepted`: the guesses its verifications accepted; `predicted`: its seconds as the
        step-time model predicted them."""
        if prefill is None:
            prefill = sum(s.num_new_tokens for s in out.scheduled if s.is_prefill)
        decode = out.num_tokens - prefill
        self.prefill_total += prefill
        self.decode_total += decode
        self.steps.append(StepRecord(now, prefill, decode, seconds, accepted, predicted))

    def since(self, t: float) -> list[StepRecord]:
        return [s for s in list(self.steps) if s.time > t]


@dataclass
class SchedulerView:
    """A scheduler at one moment: each queue's oldest `limit` requests (and how many it
    holds), the block map in cells of `blocks_per_cell` blocks (a cell shows the busiest
    state among its blocks), and the steps since the previous view."""

    time: float
    queues: dict[str, int]  # queue -> length
    requests: list[RequestView]
    blocks: str  # one of FREE / CACHED / USED / SHARED per cell
    blocks_per_cell: int
    block_counts: dict[str, int] = field(default_factory=dict)  # state -> blocks (exact)
    steps: list[StepRecord] = field(default_factory=list)


def block_states(scheduler: "Scheduler") -> list[str]:
    """Every block's state, by block id."""
    return [(SHARED if b.ref_cnt > 1 else USED) if b.ref_cnt
            else CACHED if b.block_hash is not None else FREE
            for b in scheduler.kv.pool.blocks]


def scheduler_view(scheduler: "Scheduler", history: StepHistory | None, since: float,
                   limit: int = 64, max_cells: int = 4096) -> SchedulerView:
    """The view of `scheduler` now (its clock), with the steps ended after `since`."""
    now = scheduler.clock()
    queues = {"waiting": list(scheduler.waiting),
              "preempted": list(scheduler.preempted.values()),
              "transferring": list(scheduler.transferring.values())}
    running = list(scheduler.running)
    queues["prefill"] = [r for r in running if r.is_prefilling]
    queues["decode"] = [r for r in running if not r.is_prefilling]
    requests = [RequestView(r.request_id, state, round(max(0.0, now - r.arrival_time), 3),
                            r.num_prompt_tokens, len(r.output_token_ids), r.num_computed_tokens)
                for state, members in queues.items() for r in members[:limit]]
    states = block_states(scheduler)
    per_cell = -(-len(states) // max_cells) if states else 1
    if per_cell == 1:
        cells = "".join(states)
    else:  # the busiest state of each cell: a max over strided slices of the ranks
        ranks = [_RANK[x] for x in states] + [0] * (-len(states) % per_cell)
        cells = "".join(_BY_RANK[r] for r in map(max, *(ranks[k::per_cell]
                                                         for k in range(per_cell))))
    counts = Counter(states)
    counts = {x: counts[x] for x in (FREE, CACHED, USED, SHARED)}
    return SchedulerView(now, {k: len(v) for k, v in queues.items()}, requests, cells,
                         per_cell, counts, history.since(since) if history else [])


def dashboard_frame(core: int, cores: int, model: str, stats: dict, view: SchedulerView | None,
                    latency: list, slo: dict) -> dict:
    """One dashboard event (JSON-ready): a core's counters (SchedulerStats fields plus
    prompt_tokens and generation_tokens), its view, the (finish time, TTFT, TPOT) of requests
    finished since the last event, and the SLO targets (ms, None when unset)."""
    return {"core": core, "cores": cores, "model": model, "stats": stats,
            "view": asdict(view) if view is not None else None, "latency": latency,
            "slo": slo}
