"""A sum over the tensor-parallel ranks of one machine through shared memory, where gloo's
all-reduce over loopback costs about 2 ms a call (two a layer: a decode step of a 16-layer
model spent 60 ms in them).

Each rank writes its float32 partial into its slot, publishes the call's number, waits
until every rank has published it, and sums the slots in rank order: the same order on
every rank, so every rank gets the same bits (which keeps their samples the same). Two sets
of slots alternate: a rank that runs ahead writes the set the others finished reading one
call before (they published this call only after reading the last). On x86 a core's
stores reach the others in program order, so a published number means its slot is
written; elsewhere the group keeps gloo (`supported`)."""

from __future__ import annotations

import os
import platform
import time
from multiprocessing import resource_tracker
from multiprocessing.shared_memory import SharedMemory

import numpy as np
import torch

SLOT_FLOATS = 1 << 20  # a slot's floats (4 MiB); a larger tensor is summed in pieces
_FLAG_BYTES = 64  # each rank's call number on a cache line of its own


def supported() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64")


class ShmAllReduce:
    """The shared segment of `size` ranks: rank 0 creates it (`name` None), the others
    attach to its `name`. A wait longer than `timeout_s` (a rank died or hangs) raises."""

    def __init__(self, rank: int, size: int, timeout_s: float, name: str | None = None,
                 slot_floats: int = SLOT_FLOATS) -> None:
        self.rank, self.size, self.timeout_s = rank, size, timeout_s
        self.slot_floats = slot_floats
        nbytes = size * _FLAG_BYTES + 2 * size * slot_floats * 4
        self.shm = SharedMemory(name=name, create=name is None, size=nbytes)
        if name is not None:  # attached: the creator's process unlinks it, not this one's
            resource_tracker.unregister(self.shm._name, "shared_memory")
        buf = self.shm.buf
        self.flags = np.ndarray((size, _FLAG_BYTES // 8), np.int64, buffer=buf)[:, 0]
        if name is None:
            self.flags[:] = 0
        self.slots = np.ndarray((2, size, slot_floats), np.float32, buffer=buf,
                                offset=size * _FLAG_BYTES)
        self.native = None  # the C++ extension's sum over this segment (`use_extension`)

    @property
    def name(self) -> str:
        return self.shm.name

    def use_extension(self, ext) -> object:
        """Sum through the C++ extension's ShmReduce from now on (the same bits; what the C++
        decoder calls between its projections); returns it."""
        self.native = ext.ShmReduce(self.flags.ctypes.data, self.rank, self.size,
                                    self.slot_floats, self.timeout_s)
        return self.native

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of `x` over the ranks, in x's dtype (summed in float32; float32 and
        bf16 in place where the extension sums)."""
        if self.native is not None and x.dtype in (torch.float32, torch.bfloat16):
            x = x.contiguous()
            self.native(x)
            return x
        flat = x.reshape(-1).float().numpy()
        out = np.empty_like(flat)
        for start in range(0, max(1, flat.size), self.slot_floats):
            piece = flat[start:start + self.slot_floats]
            call = int(self.flags[self.rank]) + 1  # the segment counts: C++ calls count too
            slots = self.slots[call % 2]
            slots[self.rank, :piece.size] = piece
            self.flags[self.rank] = call
            self._wait(call)
            acc = out[start:start + piece.size]
            np.copyto(acc, slots[0, :piece.size])
            for r in range(1, self.size):
                acc += slots[r, :piece.size]
        return torch.from_numpy(out).view(x.shape).to(x.dtype)

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's float32 [rows, columns] side by side in rank order, [rows, size *
        columns], through the same slots and call numbers as the sums (pieces of whole
        rows)."""
        rows, cols = x.shape
        if cols > self.slot_floats:
            raise ValueError(f"a gathered row of {cols} floats exceeds a slot's "
                             f"{self.slot_floats}")
        mine = x.numpy()
        out = np.empty((rows, self.size * cols), np.float32)
        step = self.slot_floats // cols
        for start in range(0, max(1, rows), step):
            n = min(step, rows - start)
            call = int(self.flags[self.rank]) + 1
            slots = self.slots[call % 2]
            slots[self.rank, :n * cols] = mine[start:start + n].reshape(-1)
            self.flags[self.rank] = call
            self._wait(call)
            for r in range(self.size):
                out[start:start + n, r * cols:(r + 1) * cols] = \
                    slots[r, :n * cols].reshape(n, cols)
        return torch.from_numpy(out)

    def _wait(self, calls: int) -> None:
        """Until every rank has published call `calls` (spinning: the ranks run in lockstep,
        each on cores of its own; yielding the CPU after a while)."""
        flags = self.flags
        spins, deadline = 0, None
        while flags.min() < calls:
            spins += 1
            if spins > 2000:
                os.sched_yield()
                now = time.monotonic()
                deadline = deadline or now + self.timeout_s
                if now > deadline:
                    late = [r for r in range(self.size) if flags[r] < calls]
                    raise RuntimeError(f"tensor-parallel ranks {late} did not reach all-reduce "
                                       f"{calls} in {self.timeout_s:g} s")

    def close(self) -> None:
        """Detach (and, on the creating rank, remove the segment)."""
        self.flags = self.slots = self.native = None
        self.shm.close()
        if self.rank == 0:
            self.shm.unlink()
