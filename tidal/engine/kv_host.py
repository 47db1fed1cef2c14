"""The host-memory tier of the prefix cache: KV blocks in an arena of host memory (pinned
where the pool is on a GPU, so a load is one DMA), least recently used first out. Above
the disk tier when both are on: every store goes through to the disk (which survives a
restart), and a block loaded from the disk is kept here for the next hit."""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict

import torch

from tidal.core.kv_tiers import TierReport

log = logging.getLogger("tidal.engine")


class HostKVTier:
    """At most `capacity_bytes // block_bytes` blocks in host memory; `below` (the disk
    tier, or None) takes every store and serves what this tier no longer holds. The same
    `store` / `load_into` / `keys` / `close` as `DiskKVTier`."""

    def __init__(self, block_bytes: int, capacity_bytes: int, pinned: bool,
                 below=None) -> None:
        self.block_bytes, self.below = block_bytes, below
        slots = max(0, capacity_bytes // block_bytes)
        self.arena = torch.empty((slots, block_bytes), dtype=torch.uint8, pin_memory=pinned)
        self._slots: OrderedDict[bytes, int] = OrderedDict()  # key -> arena row, LRU first
        self._free = list(range(slots))
        self._lock = threading.Lock()  # stores on the step's thread, loads on the loader's
        self.hits = 0  # loads served from memory
        self.capacity = max(slots, below.capacity if below is not None else 0)  # the index's
        log.info("KV host tier: room for %d blocks of %.1f KiB (%.2f GiB%s)", slots,
                 block_bytes / 1024, slots * block_bytes / 2**30, ", pinned" if pinned else "")

    def keys(self) -> list[bytes]:
        """The blocks this tier and the one below hold, least recently used first."""
        below = self.below.keys() if self.below is not None else []
        held = set(self._slots)
        return [k for k in below if k not in held] + list(self._slots)

    @property
    def held(self) -> int:
        """Blocks in host memory."""
        return len(self._slots)

    def store(self, key: bytes, data: bytes) -> None:
        self._keep(key, data)
        if self.below is not None:
            self.below.store(key, data)

    def load_into(self, key: bytes, out: torch.Tensor) -> bool:
        """The block copied into `out` (block_bytes of uint8) from its arena row, or read
        by the tier below (and kept here for the next hit); False if neither holds it."""
        with self._lock:
            slot = self._slots.get(key)
            if slot is not None:
                self._slots.move_to_end(key)
                self.hits += 1
                out.copy_(self.arena[slot])
                return True
        if self.below is None or not self.below.load_into(key, out):
            return False
        self._keep(key, out)
        return True

    def report(self) -> TierReport:
        """The disk's news (but for blocks this tier still holds), the blocks held here
        and the loads served from here."""
        news = self.below.report().news if self.below is not None else {}
        with self._lock:
            return TierReport({k: v for k, v in news.items() if v or k not in self._slots},
                              len(self._slots), self.hits)

    def close(self) -> None:
        if self.below is not None:
            self.below.close()

    def _keep(self, key: bytes, data: bytes | torch.Tensor) -> None:
        if len(data) != self.block_bytes or not len(self.arena):
            return
        with self._lock:
            slot = self._slots.pop(key, None)
            if slot is None:
                if not self._free:  # the least recently used block makes room
                    self._free.append(self._slots.popitem(last=False)[1])
                slot = self._free.pop()
            self.arena[slot] = (data if isinstance(data, torch.Tensor)
                                else torch.frombuffer(bytearray(data), dtype=torch.uint8))
            self._slots[key] = slot
