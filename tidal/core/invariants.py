"""What the scheduler reports about itself, and the invariants it must never break."""

from __future__ import annotations

from collections import Counter
from itertools import chain
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Callable

from tidal.core.request import RequestStatus

if TYPE_CHECKING:
    from tidal.core.kv_tiers import KVTiers
    from tidal.core.scheduler import Scheduler


class InvariantError(AssertionError):
    """The scheduler or KV cache reached a state that must be impossible."""


@dataclass(frozen=True)
class SchedulerStats:
    """A snapshot for logs and metrics."""

    running_decode: int
    running_prefill: int
    waiting: int
    preempted: int  # retracted, awaiting the executor's ack
    transferring: int
    free_blocks: int  # cached-but-unreferenced blocks included
    used_blocks: int
    cached_blocks: int  # blocks holding a reusable prefix
    num_blocks: int
    kv_usage: float  # used / num_blocks
    new_token_ratio: float
    num_preemptions: int  # retractions since start
    prefix_hit_tokens: int
    prefix_query_tokens: int
    prefix_hit_rate: float
    num_steps: int
    outstanding_tokens: int  # prompt tokens still to compute + output tokens still allowed
    unclaimed_blocks: int  # free blocks less what the waiting prompts will take
    prefill_tokens: int  # prompt tokens still to compute: what a new request's TTFT waits on
    spec_drafts: int = 0  # verifications of at least one guess, since start
    spec_draft_tokens: int = 0  # guesses verified
    spec_accepted_tokens: int = 0  # guesses accepted
    num_steps_cut: int = 0  # steps cut short for a live request, since start (step_cut.py)
    max_loras: int = 0  # adapter slots (summed over data-parallel cores)
    running_loras: list[str] = field(default_factory=list)  # adapters of requests holding blocks
    waiting_loras: list[str] = field(default_factory=list)  # adapters of waiting requests
    # the tiers below the pool (host memory, disk): blocks they may hold (0: none) and hold,
    # blocks loaded whole, stored and failed to load (missing or corrupt) since start, and
    # the mean milliseconds a block loads in
    tier_capacity: int = 0
    tier_blocks: int = 0
    tier_hit_blocks: int = 0
    tier_stored_blocks: int = 0
    tier_failed_blocks: int = 0
    tier_load_ms: float = 0.0
    # with host memory above the disk: the blocks of tier_blocks it holds, and of
    # tier_hit_blocks those it served
    tier_memory_blocks: int = 0
    tier_memory_hit_blocks: int = 0

    def as_dict(self) -> dict:
        return asdict(self)


def collect_stats(s: "Scheduler") -> SchedulerStats:
    pool = s.kv.pool
    prefill = sum(1 for r in s.running if r.is_prefilling)
    outstanding = sum(r.num_tokens - r.num_computed_tokens + r.out_limit - len(r.output_token_ids)
                      for r in s.requests.values())
    claimed = sum(-(-r.num_tokens // s.block_size) for r in s.waiting)
    return SchedulerStats(
        running_decode=len(s.running) - prefill,
        running_prefill=prefill,
        waiting=len(s.waiting),
        preempted=len(s.preempted),
        transferring=len(s.transferring),
        free_blocks=pool.num_free,
        used_blocks=pool.num_used,
        cached_blocks=pool.num_cached,
        num_blocks=pool.num_blocks,
        kv_usage=pool.num_used / pool.num_blocks,
        new_token_ratio=s.ratio.value,
        num_preemptions=s.num_preemptions,
        num_steps_cut=s.num_steps_cut,
        prefix_hit_tokens=s.prefix_hit_tokens,
        prefix_query_tokens=s.prefix_query_tokens,
        prefix_hit_rate=s.prefix_hit_tokens / max(1, s.prefix_query_tokens),
        num_steps=s.step,
        outstanding_tokens=outstanding,
        unclaimed_blocks=pool.num_free - claimed,
        prefill_tokens=s.prefill_backlog(s.waiting),
        spec_drafts=s.spec.verifications,
        spec_draft_tokens=s.spec.drafted_tokens,
        spec_accepted_tokens=s.spec.accepted_tokens,
        max_loras=s.config.max_loras,
        running_loras=sorted(s.loras.adapters_of(chain(s.running, s.transferring.values()))),
        waiting_loras=sorted(s.loras.adapters_of(chain(s.waiting, s.preempted.values()))),
        **(tier_stats(s.kv.tiers) if s.kv.tiers else {}),
    )


def tier_stats(tiers: "KVTiers") -> dict:
    return dict(tier_capacity=tiers.index.capacity, tier_blocks=len(tiers.index),
                tier_hit_blocks=tiers.hit_blocks,
                tier_stored_blocks=tiers.stored_blocks, tier_failed_blocks=tiers.failed_blocks,
                tier_load_ms=tiers.load_seconds * 1000, tier_memory_blocks=tiers.memory_blocks,
                tier_memory_hit_blocks=tiers.memory_hit_blocks)


def _check_tier(s: "Scheduler") -> None:
    """The tier below the pool (docs/design/kv-tiers.md): its index within its capacity; a
    request's blocks that are loading held by it alone, never free nor published; a
    request loading inline is running and loads in the last plan, and no step computes a
    request loading beside it (nothing reads its blocks before they are loaded)."""
    kv, pool, out = s.kv, s.kv.pool, s.last_output
    _require(len(kv.tiers.index) <= kv.tiers.index.capacity, "the tier holds too many blocks")
    inline = {x.request_id: x.block_ids for x in out.kv_loads if x.inline} if out else {}
    beside = {rid for rid, r in s.transferring.items() if r.tier_loading}
    for rid in beside | {r.request_id for r in s.running if r.tier_loading}:
        table, keys = kv.tables[rid], s.requests[rid].tier_loading
        _require(rid in beside or rid in inline,
                 lambda: f"{rid}: running while loading, not inline in the last plan")
        for b in inline.get(rid) or table[len(table) - len(keys):]:
            block = pool.blocks[b]
            _require(block.ref_cnt == 1 and block.block_hash is None,
                     lambda: f"{rid}: block {b} is loading but shared, free or published")
    _require(out is None or not any(x.request_id in beside for x in out.scheduled),
             "a step computes a request whose blocks are still loading beside it")
    for r in chain(s.waiting, s.preempted.values()):
        _require(not r.tier_loading, lambda: f"{r}: loading blocks but not waiting for them")


def _require(ok: bool, message: str | Callable[[], str]) -> None:
    """Raise with `message` unless ok; a callable message is formatted only on failure."""
    if not ok:
        raise InvariantError(message() if callable(message) else message)


def check_invariants(s: "Scheduler") -> None:
    """Blocks: free + used == total, ref counts equal table membership, nothing both free and
    owned, only block-holding requests own blocks. Requests: each in exactly the container
    its status names. Step: the last plan kept its budgets."""
    kv, pool = s.kv, s.kv.pool
    free = set(pool.free_block_ids())
    _require(len(free) == pool.num_free, "a block is twice in the free queue")
    _require(pool.num_free + pool.num_used == pool.num_blocks, "free + used != num_blocks")
    owners = Counter(b for table in kv.tables.values() for b in table)
    for block in pool.blocks:
        _require(block.ref_cnt == owners.get(block.block_id, 0),
                 lambda: f"block {block.block_id}: ref_cnt {block.ref_cnt} but "
                 f"{owners.get(block.block_id, 0)} tables hold it")
        _require((block.ref_cnt == 0) == (block.block_id in free),
                 lambda: f"block {block.block_id} is both free and owned, or neither")
        if block.block_hash is not None:
            _require(pool._cached.get(block.block_hash) is block,
                     lambda: f"block {block.block_id} has a hash the cache map does not "
                     "point back to")
    _require(len(pool._cached) == sum(b.block_hash is not None for b in pool.blocks),
             "the cache map names blocks that lost their hash")

    holders = {r.request_id for r in s.running} | set(s.transferring)
    _require(set(kv.tables) == holders,
             lambda: f"block tables {sorted(set(kv.tables) ^ holders)} belong to requests that "
             "should (or should not) hold blocks")
    expected = (
        [(r, RequestStatus.WAITING) for r in s.waiting]
        + [(r, RequestStatus.RUNNING) for r in s.running]
        + [(r, RequestStatus.PREEMPTED) for r in s.preempted.values()]
        + [(r, RequestStatus.TRANSFERRING) for r in s.transferring.values()]
    )
    _require(len(expected) == len(s.requests), "a request is in no queue or in two")
    for r, status in expected:
        _require(r.status is status, lambda: f"{r} sits where {status.name} requests sit")
        _require(s.requests.get(r.request_id) is r, lambda: f"{r} is queued but not registered")
        _require(r.num_in_flight >= 0, lambda: f"{r} has a negative in-flight count")
    for r in s.running:
        table = kv.tables[r.request_id]
        _require(len(table) * kv.block_size >= r.num_computed_tokens,
                 lambda: f"{r}: its blocks do not cover its computed tokens")
        _require(r.num_computed_tokens <= r.num_tokens + r.num_in_flight + r.num_guesses,
                 lambda: f"{r}: computed tokens run ahead of known ones")
        _require(r.num_guesses <= s.config.num_speculative_tokens
                 and (not r.num_guesses or r.num_in_flight >= 1),
                 lambda: f"{r}: {r.num_guesses} guesses in flight without a verification")
    for r in chain(s.waiting, s.preempted.values()):
        _require(not r.num_guesses, lambda: f"{r}: guesses in flight while not running")
    for r in s.waiting:
        _require(r.num_computed_tokens == 0 and r.request_id not in kv.tables,
                 lambda: f"{r}: waiting with computed tokens or blocks")
    if kv.tiers is not None:
        _check_tier(s)
    adapters = {r.lora for r in chain(s.running, s.transferring.values()) if r.lora is not None}
    _require(len(adapters) <= s.config.max_loras,
             lambda: f"{len(adapters)} LoRA adapters hold blocks; max_loras is "
             f"{s.config.max_loras}")
    prefilling = [r for r in s.running if r.is_prefilling]
    if not s.role.concurrent_prefills:
        _require(len(prefilling) <= 1, lambda: f"{len(prefilling)} chunked prefills at once")
        _require(s.active_prefill is (prefilling[0] if prefilling else None),
                 "active_prefill is not the one partially prefilled request")

    out = s.last_output
    if out is not None and not s.role.concurrent_prefills:
        decodes = sum(1 for x in out.scheduled if not x.is_prefill)
        others = out.num_tokens - decodes  # prefill tokens and guesses
        cap = max(0, s.config.max_input_tokens_per_step - decodes)
        _require(others <= cap,
                 lambda: f"step {out.step} computed {others} prefill tokens and guesses over "
                 "its budget")
        chunked = [x for x in out.scheduled if not x.samples]
        _require(len(chunked) <= 1, lambda: f"step {out.step} cut {len(chunked)} chunked prefills")
        for x in chunked:
            _require(x.num_new_tokens <= s.config.chunked_prefill_size,
                     lambda: f"step {out.step}: a chunk of {x.num_new_tokens} tokens")
            _require((x.num_computed_tokens + x.num_new_tokens) % kv.block_size == 0,
                     lambda: f"step {out.step}: a chunk ending off a block boundary")
        _require(len(set(x.request_id for x in out.scheduled)) == len(out.scheduled),
                 f"step {out.step} scheduled a request twice")
    if out is not None:
        # a request whose inline load failed was left out of its step: it waits again
        left_out = {x.request_id for x in out.kv_loads if x.inline}
        for x in out.scheduled:  # its blocks must not have been given away in the same plan
            _require(x.is_prefill or x.num_new_tokens - 1 <= s.config.num_speculative_tokens,
                     lambda: f"step {out.step}: a decode of {x.num_new_tokens} positions")
            r = s.requests.get(x.request_id)
            _require(r is None or r.status in (RequestStatus.RUNNING, RequestStatus.TRANSFERRING)
                     or (x.request_id in left_out and r.status is RequestStatus.WAITING),
                     lambda: f"step {out.step} scheduled {r}, which no longer holds its blocks")
