"""The tier below the pool's prefix cache, as the scheduler sees it: block keys that are the
same in every process, the index of the blocks the tier holds (least recently used first,
bounded), the stores to plan, and what loading costs.

The protocol (docs/design/kv-tiers.md): a block published to the prefix cache is stored
too (its KV copied by the runner at the start of the next step, before any forward pass
can overwrite it, and written out by a thread). A waiting request whose prefix continues
in the tier past the pool's hit, where loading is predicted faster than computing, loads:
- inline, when it is admitted: its step reads those blocks before its forward pass, which
  computes the rest of the prompt (they are published only once the step returns). A
  request whose load fails is left out of that pass and rejoins the waiting queue.
- beside a step, when it waits for room (the head of the queue) or the executor runs a
  step ahead: it takes fresh blocks and waits in `transferring`, computing nothing, while
  the runner reads them beside a step that reads none of them.
The step's result says how many leading blocks loaded whole; those are published, and a
request that rejoins the queue finds them as an ordinary prefix hit. A block that failed
to load is computed instead; a request loads at most once."""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field
from itertools import chain
from typing import TYPE_CHECKING, Hashable, Iterable

from tidal.core.outputs import KVLoad
from tidal.core.policies.base import foreground_first
from tidal.core.request import RequestStatus
from tidal.core.step_time import StepShape

if TYPE_CHECKING:
    from tidal.core.budget import StepPlan
    from tidal.core.outputs import ModelOutput, SchedulerOutput
    from tidal.core.request import Request
    from tidal.core.scheduler import Scheduler


def tier_key(parent: bytes | None, token_ids: tuple[int, ...], extra_key: Hashable) -> bytes:
    """A full block's key in the tier: a digest of its tokens, the key of the block before
    it and the request's extra key (its LoRA adapter, its salt), equal in every process
    (Python's `hash` of a string is not)."""
    digest = hashlib.blake2b(parent or b"", digest_size=16)
    digest.update(array("q", token_ids).tobytes())
    digest.update(repr(extra_key).encode())
    return digest.digest()


class TierIndex:
    """The keys of the blocks a tier holds, least recently used first, at most `capacity`:
    adding one past it forgets the oldest (the tier deletes its bytes in the same order)."""

    def __init__(self, capacity: int, keys: Iterable[bytes] = ()) -> None:
        self.capacity = capacity
        self._keys: OrderedDict[bytes, None] = OrderedDict()
        self.evicted = 0  # keys forgotten to stay within capacity
        for key in keys:
            self.add(key)

    def __contains__(self, key: bytes) -> bool:
        return key in self._keys

    def __len__(self) -> int:
        return len(self._keys)

    def add(self, key: bytes) -> None:
        self._keys[key] = None
        self._keys.move_to_end(key)
        while len(self._keys) > self.capacity:
            self._keys.popitem(last=False)
            self.evicted += 1

    def touch(self, key: bytes) -> None:
        if key in self._keys:
            self._keys.move_to_end(key)

    def discard(self, key: bytes) -> None:
        self._keys.pop(key, None)


@dataclass
class TierReport:
    """What the tiers below the pool tell the scheduler before each plan and after each
    step: blocks another process wrote to the disk tier (True) or deleted from it (False),
    and, with host memory above the disk, the blocks it holds and the loads it served."""

    news: dict[bytes, bool] = field(default_factory=dict)
    memory_blocks: int = 0
    memory_hits: int = 0


class KVTiers:
    """The scheduler's side of the tier below its pool (one per KV cache manager): which
    blocks it holds (`index`), the stores the next step carries (`take_stores`), and the
    counters the metrics report. `load_seconds` is the measured seconds a block takes to
    load (learned from the steps' results; 0 until one loaded: loading is tried)."""

    def __init__(self, capacity: int, keys: Iterable[bytes] = ()) -> None:
        self.index = TierIndex(capacity, keys)
        self._stores: list[tuple[int, bytes]] = []  # (block id, key), for the next step
        self.load_seconds = 0.0
        self.hit_blocks = 0  # blocks loaded whole
        self.failed_blocks = 0  # loads that failed (missing or corrupt): computed instead
        self.stored_blocks = 0  # blocks planned to store
        self.memory_blocks = 0  # of which host memory above the disk holds (TierReport)
        self.memory_hit_blocks = 0  # of the blocks loaded, those host memory served

    def keys(self, request: "Request", num_blocks: int) -> list[bytes]:
        """Tier keys of the request's first `num_blocks` full blocks, memoised in
        `request.tier_keys` (their tokens are `request.block_tokens`: the caller hashed them
        first)."""
        keys = request.tier_keys
        for tokens in request.block_tokens[len(keys):num_blocks]:
            keys.append(tier_key(keys[-1] if keys else None, tokens, request.extra_key))
        return keys

    def stored(self, block_id: int, key: bytes) -> None:
        """A block just published to the prefix cache: store it unless the tier holds it."""
        if key in self.index:
            self.index.touch(key)
            return
        self.index.add(key)  # readable once written; a load before that finds it pending
        self._stores.append((block_id, key))
        self.stored_blocks += 1

    @property
    def pending(self) -> bool:
        """Whether stores wait for a step to carry them."""
        return bool(self._stores)

    def learn(self, report: TierReport) -> None:
        """The tiers' report: blocks another process wrote to the tier (held now, most
        recent) or deleted from it, and host memory's figures."""
        for key, held in report.news.items():
            if held:
                self.index.add(key)
            else:
                self.index.discard(key)
        self.memory_blocks, self.memory_hit_blocks = report.memory_blocks, report.memory_hits

    def take_stores(self) -> list[tuple[int, bytes]]:
        stores, self._stores = self._stores, []
        return stores

    def run(self, request: "Request", start: int, stop: int) -> list[bytes]:
        """The keys of the request's blocks from `start` that the tier holds, up to `stop`
        or the first it lacks (keys computed only that far)."""
        out: list[bytes] = []
        for i in range(start, stop):
            key = self.keys(request, i + 1)[i]
            if key not in self.index:
                break
            out.append(key)
        return out

    def worth_loading(self, blocks: int, recompute_seconds: float) -> bool:
        """Whether loading `blocks` is predicted faster than computing them (no price for
        computing, 0: load)."""
        return not recompute_seconds or blocks * self.load_seconds < recompute_seconds

    def loaded(self, keys: list[bytes], whole: int) -> None:
        """A load's outcome: its first `whole` blocks loaded; the block after them (if any)
        failed and leaves the index."""
        self.hit_blocks += whole
        for key in keys[:whole]:
            self.index.touch(key)
        if whole < len(keys):
            self.failed_blocks += 1
            self.index.discard(keys[whole])

    def timed(self, blocks: int, seconds: float) -> None:
        """A step loaded `blocks` in `seconds`: a moving average, as the disk's speed drifts
        with the page cache."""
        if blocks:
            per_block = seconds / blocks
            self.load_seconds = (per_block if not self.load_seconds
                                 else 0.8 * self.load_seconds + 0.2 * per_block)


def tier_run(sched: "Scheduler", r: "Request", hit: list) -> list[bytes]:
    """Keys of the request's blocks past the pool's `hit` that the tier holds, where
    loading them is predicted faster than computing them (else none)."""
    kv, bs = sched.kv, sched.block_size
    keys = kv.match_tier(r, len(hit))
    if not keys:
        return []
    model = sched.step_time
    recompute = (model.shape_time(StepShape().add(len(keys) * bs, len(hit) * bs))
                 if model is not None else 0.0)
    return keys if kv.tiers.worth_loading(len(keys), recompute) else []


def loads_inline(sched: "Scheduler", r: "Request") -> bool:
    """Whether an admitted request loads inline: not where the executor runs a step ahead
    (that step was planned before this one's loads are known), nor for a prompt whose KV
    arrives from a prefill instance."""
    return not sched.config.executor_ahead and not r.remote_prefill


def load_inline(plan: "StepPlan", r: "Request", block_ids: list[int],
                keys: list[bytes]) -> None:
    """An admitted request's tier blocks (`block_ids`, just allocated after its pool hit)
    load before its step's forward pass."""
    r.tier_loading = keys
    plan.out.kv_loads.append(KVLoad(r.request_id, block_ids, keys, inline=True))


def admit_load(sched: "Scheduler", plan: "StepPlan", r: "Request", hit: list,
               keys: list[bytes], reserved: float, margin: int) -> bool:
    """Admit a fresh request as a load beside the step, if fresh blocks for `keys` fit
    within the reservation and margin an admission keeps: a `KVLoad` in the plan, and the
    request waits in `transferring`, computing nothing, until `loads_done`."""
    if not sched._allocate(r, len(keys) * sched.block_size, hit, reserved, margin):
        return False
    r.tier_loading = keys
    r.status = RequestStatus.TRANSFERRING
    sched.transferring[r.request_id] = r
    plan.out.kv_loads.append(KVLoad(r.request_id, sched.kv.block_ids(r.request_id)[len(hit):],
                                    keys))
    return True


def prefetch(sched: "Scheduler", plan: "StepPlan") -> None:
    """Start loading the prefix of the request at the head of the waiting queue (in policy
    order) that this step did not admit, so that it loads while it waits for room and is a
    prefix hit once admitted; under the same conditions as a load at admission (a seat, its
    adapter's slot held already, the blocks within the reservation and margin)."""
    if (not sched.waiting or not len(sched.kv.tiers.index)  # nothing to load: no order
            or len(sched.running) + len(sched.transferring) >= plan.max_seqs):
        return
    r = foreground_first(sched.policy.order(sched.waiting, sched.step,
                                            sched._prefix_tokens))[0]
    held = sched.loras.adapters_of(chain(sched.running, sched.transferring.values()))
    if r.tier_loading is not None or (r.lora is not None and r.lora not in held):
        return
    margin = int(sched.config.safety_margin * sched.kv.num_blocks)
    hit = sched.kv.match_prefix(r)
    keys = tier_run(sched, r, hit)
    if keys and admit_load(sched, plan, r, hit, keys, plan.reserved_tokens, margin):
        sched.waiting.remove(r)


def loads_done(sched: "Scheduler", out: "SchedulerOutput", result: "ModelOutput") -> None:
    """A step's loads came back (one the result lacks failed at its first block): the
    blocks that loaded whole are the tier's hit and are published. A request whose inline
    load loaded whole goes on running; any other gives its blocks back and rejoins the
    head of the waiting queue, where the one admission path finds the loaded blocks as a
    prefix hit and computes the rest. It never loads again."""
    tiers, kv = sched.kv.tiers, sched.kv
    tiers.timed(sum(result.kv_loaded.values()), result.kv_load_seconds)
    rejoined = []
    for load in out.kv_loads:
        rid = load.request_id
        r = sched.requests.get(rid)
        if r is None or not r.tier_loading:
            continue  # finished or aborted meanwhile: its blocks went back then
        whole = result.kv_loaded.get(rid, 0)
        keys, r.tier_loading = r.tier_loading, []
        tiers.loaded(keys, whole)
        kv.cache_computed(r, (kv.block_ids(rid).index(load.block_ids[0]) + whole)
                          * sched.block_size)
        if r.status is RequestStatus.RUNNING:
            if whole == len(keys):
                continue  # its step computed the rest of its prompt
            sched.running.remove(r)  # left out of its step's forward pass
            if sched.active_prefill is r:
                sched.active_prefill = None
            r.num_computed_tokens = r.prefill_target = 0
        else:
            del sched.transferring[rid]
        kv.free(r)
        r.status = RequestStatus.WAITING
        rejoined.append(r)
    sched.waiting[:0] = rejoined  # in the order they were admitted to load
