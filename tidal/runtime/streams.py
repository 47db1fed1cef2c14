"""Per-request streams: the cores' token outputs, detokenized, onto one asyncio.Queue per
request (several requests may share one: updates carry their root id), or a Failure."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from tidal.core import SamplingParams
from tidal.engine import messages as m
from tidal.engine.output_processor import OutputProcessor
from tidal.model.tokenizer import Tokenizer


@dataclass
class Failure:
    """Put on a request's queue instead of an update when it cannot go on."""

    message: str
    dead: bool = False  # the engine core died (HTTP 503) rather than refused (400)


class RequestStreams:
    """The open requests' queues and their detokenizing state."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.outputs = OutputProcessor(tokenizer)
        self.queues: dict[str, asyncio.Queue] = {}
        self.widths: dict[str, int] = {}  # each open request's n
        self.begun: set[str] = set()  # open requests some output of which arrived
        self.held: dict[str, m.Add] = {}  # open requests a hold keeps unsent, as they came

    def __len__(self) -> int:
        return len(self.queues)

    def open(self, request_id: str, params: SamplingParams,
             queue: asyncio.Queue | None = None) -> asyncio.Queue:
        queue = queue if queue is not None else asyncio.Queue()
        self.queues[request_id] = queue
        self.outputs.track(request_id, params)
        self.widths[request_id] = params.n
        return queue

    def hold(self, msg: m.Add) -> None:
        """An opened request waits unsent until `take_held`."""
        self.held[msg.request_id] = msg

    def take_held(self) -> list[m.Add]:
        """The held requests still open, in the order they came; none is held after."""
        held, self.held = list(self.held.values()), {}
        return held

    @property
    def num_sent(self) -> int:
        """Open requests sent to the cores (not held)."""
        return len(self.queues) - len(self.held)

    def sent_ids(self) -> list[str]:
        return [rid for rid in self.queues if rid not in self.held]

    def close(self, request_id: str) -> None:
        """Forget a request: finished, aborted, or never sent."""
        self.queues.pop(request_id, None)
        self.outputs.forget(request_id)
        self._untrack(request_id)

    @property
    def num_sequences(self) -> int:
        """The open requests' sequences: the sum of their n."""
        return sum(self.widths.values())

    def _untrack(self, request_id: str) -> None:
        self.widths.pop(request_id, None)
        self.begun.discard(request_id)
        self.held.pop(request_id, None)

    def deliver(self, msg: m.Outputs) -> list[str]:
        """One step's outputs onto their queues; returns the sequences whose text met a stop
        string (the core must be told to finish them)."""
        updates, stopped = self.outputs.process(msg.outputs)
        for u in updates:
            queue = self.queues.get(u.root_id)
            if queue is not None:
                queue.put_nowait(u)
                self.begun.add(u.root_id)
        return stopped

    def end(self, request_id: str, reason: str, message: str) -> None:
        """End an open request here: its unfinished sequences' last updates (`reason`, the
        text so far) go on its queue, then it is forgotten (the caller frees it in the core)."""
        queue = self.queues.get(request_id)
        for u in self.outputs.end(request_id, reason, message):
            if queue is not None:
                queue.put_nowait(u)
        self.close(request_id)

    def fail(self, request_id: str, message: str, dead: bool) -> None:
        self.outputs.forget(request_id)
        self._untrack(request_id)
        queue = self.queues.pop(request_id, None)
        if queue is not None:
            queue.put_nowait(Failure(message, dead=dead))

    def fail_all(self, message: str, dead: bool) -> None:
        for rid in list(self.queues):
            self.fail(rid, message, dead)
