"""The Responses API's store: responses created with `store: true`, kept in memory for
`GET /v1/responses/{id}` and for `previous_response_id` to continue their conversation.
Bounded by bytes (the oldest go first) and by age; nothing survives a restart."""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable

import msgspec


@dataclass(frozen=True)
class StoredResponse:
    """A response as sent (JSON), and its conversation as chat messages: the input it
    answered (after its predecessors') and its own output; None for a background response
    not (or never) finished, which no successor continues."""

    body: bytes
    messages: list[dict] | None
    size: int
    expires: float


class ResponseStore:
    """Response id -> StoredResponse, at most `max_bytes` in all (0: nothing is kept) and
    each for `ttl` seconds."""

    def __init__(self, max_bytes: int, ttl: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.max_bytes, self.ttl, self.clock = max_bytes, ttl, clock
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self.bytes = 0

    def put(self, response_id: str, body: bytes, messages: list[dict] | None) -> bool:
        """Keep a response; False when it alone is over the bound (it is not kept)."""
        size = len(body) + len(msgspec.json.encode(messages))
        self.delete(response_id)
        if size > self.max_bytes:
            return False
        while self.bytes + size > self.max_bytes:  # the oldest make room
            self._drop(next(iter(self._entries)))
        self._entries[response_id] = StoredResponse(body, messages, size,
                                                    self.clock() + self.ttl)
        self.bytes += size
        return True

    def get(self, response_id: str) -> StoredResponse | None:
        """The response, or None when unknown, deleted, evicted or expired."""
        self._expire()
        return self._entries.get(response_id)

    def delete(self, response_id: str) -> bool:
        """Forget a response; False if it was not there."""
        if response_id not in self._entries:
            return False
        self._drop(response_id)
        return True

    def __len__(self) -> int:
        self._expire()
        return len(self._entries)

    def _expire(self) -> None:
        now = self.clock()
        while self._entries:  # kept in the order they expire: ttl is the same for all
            oldest = next(iter(self._entries))
            if self._entries[oldest].expires > now:
                break
            self._drop(oldest)

    def _drop(self, response_id: str) -> None:
        self.bytes -= self._entries.pop(response_id).size
