"""The frontend's ZMQ sockets: one PUSH socket to each engine core (synchronous, serialised
by a lock, because the dispatcher's thread sends too) and one PULL socket all cores send to."""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
import threading
import uuid

import zmq
import zmq.asyncio

from tidal.engine import messages as m


class CoreSockets:
    """Bound before any core starts, so a restarted core connects to the same addresses."""

    def __init__(self, num_cores: int, host: str | None) -> None:
        name = f"tidal-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        # Linux's abstract socket namespace: no file to leave behind, even if killed
        base = f"@{name}" if sys.platform.startswith("linux") else \
            os.path.join(tempfile.gettempdir(), name)
        self._sync_ctx, self._ctx = zmq.Context(), zmq.asyncio.Context()
        self._lock = threading.Lock()
        self._to_core: list[zmq.Socket] = []
        self.in_addrs: list[str] = []  # where core i reads its messages
        for i in range(num_cores):
            sock = self._sync_ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.SNDHWM, 0)  # queue rather than block the event loop
            self.in_addrs.append(_bind(sock, host, f"{base}-in{i}"))
            self._to_core.append(sock)
        self._from_core = self._ctx.socket(zmq.PULL)
        self.out_addr = _bind(self._from_core, host, f"{base}-out")  # where every core sends

    def send(self, core: int, msg: m.ToCore) -> bool:
        """Send without blocking; False when no core process is connected to take it."""
        with self._lock:
            try:  # the queue is unbounded: only a missing peer makes this fail
                self._to_core[core].send(m.encoder.encode(msg), zmq.NOBLOCK)
                return True
            except zmq.Again:
                return False

    async def recv(self) -> m.FromCore:
        return m.from_core.decode(await self._from_core.recv())

    def close(self) -> None:
        for sock in self._to_core:
            sock.close(linger=0)
        self._from_core.close(linger=0)
        self._sync_ctx.term()
        self._ctx.term()
        for addr in [*self.in_addrs, self.out_addr]:  # socket files, where there are any
            path = addr.removeprefix("ipc://")
            if addr.startswith("ipc://") and not path.startswith("@"):
                with contextlib.suppress(OSError):
                    os.unlink(path)


def _bind(sock: zmq.Socket, host: str | None, path: str) -> str:
    """Bind to an ipc path (local cores) or a free TCP port on `host` (Ray actors)."""
    if host is None:
        sock.bind(f"ipc://{path}")
        return f"ipc://{path}"
    return f"tcp://{host}:{sock.bind_to_random_port(f'tcp://{host}')}"
