"""The data-parallel dispatcher: one thread gathers incoming requests into batches and routes
each to an engine core (docs/design/data-parallel.md).

A batch closes when `batch_timeout` has passed since its first request, or its prompt tokens
reach the token budget, or the chosen core's free blocks (prompt plus reserved output) would
not cover the next request; that request and those behind it stay queued, uncounted, until a
core reports room. Cores report free blocks and load; the dispatcher subtracts what it sent
since a core's last report, so a burst between reports does not overfill one core.
Transport-free: `send(core, message)` delivers (ZMQ to a process or a Ray actor alike).
"""

from __future__ import annotations

import math
import threading
import time
from collections import Counter, deque
from dataclasses import dataclass, field, replace
from typing import Callable

from tidal.cluster.prefix_index import PrefixIndex, block_hashes
from tidal.cluster.routing import CoreLoad, Router
from tidal.engine.messages import Abort, Add


@dataclass
class CoreView:
    """The dispatcher's picture of one core: its last report, less what was sent since."""

    num_blocks: int
    free_blocks: int = 0  # free for new requests at the last report (its waiting queue's needs out)
    outstanding_tokens: int = 0
    prefill_tokens: int = 0  # prompt tokens queued at the last report
    new_token_ratio: float = 1.0  # share of max_tokens the core reserves for a new request
    alive: bool = True
    adds_sent: int = 0
    # (add number, blocks, tokens, prompt tokens) sent and not yet in a report
    unseen: deque = field(default_factory=deque)

    def free(self) -> int:
        return self.free_blocks - sum(u[1] for u in self.unseen)

    def load(self) -> int:
        return self.outstanding_tokens + sum(u[2] for u in self.unseen)

    def prefill_load(self) -> int:
        return self.prefill_tokens + sum(u[3] for u in self.unseen)


class Dispatcher:
    """Queue, batch and route requests (the frontend's Add messages) to `num_cores` cores,
    sending each with `send(core, message)`, which returns False where the core is gone.
    Thread-safe; `close()` ends the gathering thread."""

    def __init__(self, router: Router, send: Callable[[int, Add | Abort], bool | None],
                 num_blocks: int, block_size: int, max_batch_tokens: int,
                 batch_timeout: float = 0.1) -> None:
        self.router, self.send = router, send
        self.block_size, self.max_batch_tokens = block_size, max_batch_tokens
        self.batch_timeout = batch_timeout
        self.views = [CoreView(num_blocks, free_blocks=num_blocks)
                      for _ in range(router.num_cores)]
        self.prefixes = [PrefixIndex(block_size, num_blocks) for _ in range(router.num_cores)]
        # LoRA adapters of the requests each core holds (sent, not done): where they are hot
        self.adapters = [Counter() for _ in range(router.num_cores)]
        self.core_of: dict[str, int] = {}
        self.sent: dict[str, Add] = {}  # routed requests, kept to replay if their core dies
        self.batches = 0  # batches sent, for tests and logs
        self.routed = [0] * router.num_cores  # requests sent to each core, restarts included
        self._queue: deque[tuple[float, Add]] = deque()
        self._cond = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="tidal-dp-dispatcher",
                                        daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> list[Add]:
        """Stop the gathering thread; returns the requests still queued (never sent)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        with self._cond:
            left = [item for _, item in self._queue]
            self._queue.clear()
        return left

    # ------------------------------------------------------------------ from the frontend
    def submit(self, item: Add) -> None:
        with self._cond:
            if self._closed:
                raise RuntimeError("the dispatcher is shut down")
            self._queue.append((time.monotonic(), item))
            self._cond.notify_all()

    def abort(self, request_id: str) -> None:
        """Drop a queued request, or send its Abort to the core it went to; under the lock,
        so an abort never overtakes the request it cancels."""
        with self._cond:
            for entry in self._queue:
                if entry[1].request_id == request_id:
                    self._queue.remove(entry)
                    return
            core = self._forget(request_id)
            if core is not None and self.views[core].alive:
                self.send(core, Abort(request_id))

    def done(self, request_id: str) -> None:
        """The request finished: forget where it went."""
        with self._cond:
            self._forget(request_id)

    def _forget(self, request_id: str) -> int | None:
        core = self.core_of.pop(request_id, None)
        item = self.sent.pop(request_id, None)
        if core is not None and item is not None and item.params.lora is not None:
            self.adapters[core][item.params.lora] -= 1
        return core

    @property
    def num_queued(self) -> int:
        return len(self._queue)

    # ------------------------------------------------------------------ from the cores
    def report(self, core: int, free_blocks: int, outstanding_tokens: int,
               new_token_ratio: float, adds_seen: int, prefill_tokens: int = 0) -> None:
        """A core's stats: its free blocks and load after its first `adds_seen` requests."""
        with self._cond:
            v = self.views[core]
            while v.unseen and v.unseen[0][0] < adds_seen:
                v.unseen.popleft()
            v.free_blocks, v.outstanding_tokens = free_blocks, outstanding_tokens
            v.prefill_tokens = prefill_tokens
            v.new_token_ratio = new_token_ratio
            self._cond.notify_all()

    def core_died(self, core: int, begun: Callable[[str], bool] = lambda rid: True
                  ) -> list[str]:
        """Route nothing more to `core`. Its requests that have not `begun` (no output
        reached the client: sent after it died, before its death was seen, or queued in
        it) go back to the head of the queue, for the live cores; returns the rest (to be
        failed)."""
        with self._cond:
            self.views[core].alive = False
            self.adapters[core].clear()
            held = [rid for rid, c in self.core_of.items() if c == core]
            lost, replay = [], []
            for rid in held:
                del self.core_of[rid]
                item = self.sent.pop(rid, None)
                if item is not None and not begun(rid):
                    replay.append((time.monotonic(), item))
                else:
                    lost.append(rid)
            self._queue.extendleft(reversed(replay))  # ahead of later arrivals, in order
            self._cond.notify_all()
            return lost

    def core_rejoined(self, core: int) -> None:
        """`core` was started again: route to it, as empty (no load, no cached prefixes)."""
        with self._cond:
            num_blocks = self.views[core].num_blocks
            self.views[core] = CoreView(num_blocks, free_blocks=num_blocks)
            self.prefixes[core] = PrefixIndex(self.block_size, num_blocks)
            self._cond.notify_all()

    def forget_prefixes(self) -> None:
        """The cores' prefix caches were reset: route as if none held a prefix."""
        with self._cond:
            self.prefixes = [PrefixIndex(self.block_size, v.num_blocks) for v in self.views]

    # ------------------------------------------------------------------ the thread
    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                deadline = self._queue[0][0] + self.batch_timeout
                while (not self._closed and time.monotonic() < deadline
                       and self._queued_tokens() < self.max_batch_tokens):
                    self._cond.wait(deadline - time.monotonic())
                if self._closed:
                    return
                if not self._route_batch():  # nothing fits: wait for a core to report room
                    self._cond.wait(self.batch_timeout)

    def _queued_tokens(self) -> int:
        return sum(len(item.prompt_token_ids) for _, item in self._queue)

    def _route_batch(self) -> int:
        """Route requests from the head of the queue until the budget or a full core stops
        the batch; sends them (holding the lock). Returns how many went."""
        tokens = sent = 0
        while self._queue:
            item = self._queue[0][1]
            n = len(item.prompt_token_ids)
            if sent and tokens + n > self.max_batch_tokens:
                break
            hashes = block_hashes(item.prompt_token_ids, self.block_size)
            core = self._choose(hashes, item.params.lora)
            if core is None:  # every core is dead: the frontend fails what is queued
                break
            v = self.views[core]
            reserve = math.ceil(item.params.max_tokens * v.new_token_ratio)
            blocks = -(-(n + reserve) // self.block_size)
            # A request larger than a whole core goes anyway: the core refuses it, clearly.
            if blocks > v.free() and blocks <= v.num_blocks:
                break
            if self.send(core, item) is False:  # the core is gone, its death not yet seen
                v.alive = False  # (until core_rejoined); the request tries another
                continue
            self._queue.popleft()
            self.core_of[item.request_id] = core
            self.sent[item.request_id] = item
            v.unseen.append((v.adds_sent, blocks, n + item.params.max_tokens, n))
            v.adds_sent += 1
            self.routed[core] += 1
            self.prefixes[core].insert(hashes)
            if item.params.lora is not None:
                self.adapters[core][item.params.lora] += 1
            tokens += n
            sent += 1
        self.batches += sent > 0
        return sent

    def _choose(self, hashes: list[int], lora: str | None = None) -> int | None:
        """The router's pick; a request of a LoRA adapter goes among the cores already
        holding requests of it (its slot is loaded there), unless those all carry more
        than a batch of tokens over the least loaded core."""
        loads = [CoreLoad(v.load(), v.free(),
                          self.prefixes[i].match(hashes) if self.router.needs_prefix else 0,
                          v.prefill_load(), v.alive) for i, v in enumerate(self.views)]
        if not any(v.alive for v in self.views):
            return None
        if lora is not None:
            least = min(x.outstanding_tokens for x in loads if x.available)
            near = {i for i, x in enumerate(loads) if x.available and self.adapters[i][lora] > 0
                    and x.outstanding_tokens <= least + self.max_batch_tokens}
            if near:
                loads = [x if i in near else replace(x, available=False)
                         for i, x in enumerate(loads)]
        return self.router.choose(loads)
