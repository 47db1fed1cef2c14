"""The online Batch API's worker: it takes the store's oldest batch with work left and sends
its unanswered lines to the server's own app in this process, at low priority: up to
--batch-concurrency lines at once while no live request is in flight, one while any is
(the batch still moves), each marked as a background request, which the scheduler admits
after live ones and keeps out of the steps that prefill a live prompt. Each answer is kept
as it comes back; a batch ends when every line has one (or when cancelled or expired). One
server at a time works through a store (an exclusive lock on a file beside it), and
deletes its expired files."""

from __future__ import annotations

import asyncio
import fcntl
import logging
import os
import threading
import time
import uuid
from pathlib import Path

import httpx

from tidal.server.batches.lines import answer, custom_id_of, output
from tidal.server.batches.store import BatchStore

log = logging.getLogger("tidal.batches")

BACKGROUND_HEADER = "x-tidal-background"
"""Carries the runner's token: the frontend sends such requests as background ones and
counts them apart from live ones."""
PURGE_EVERY = 60.0  # seconds between deletions of expired files, by the store's worker
EXPIRED = {"code": "batch_expired", "message": "the batch expired before this line was answered"}


class BatchRunner:
    """The store at `path` (opened when first asked for, or found there) and the work
    through its batches for as long as the server runs (`run`)."""

    def __init__(self, frontend, app, path: Path, concurrency: int, file_days: float = 0.0,
                 poll: float = 1.0) -> None:
        self.frontend, self.app, self.path = frontend, app, path
        self.concurrency, self.poll = concurrency, poll
        self.file_seconds = round(file_days * 86400)  # batch files' expiry (0: never)
        self._purged = 0.0  # when expired files were last deleted
        self.token = uuid.uuid4().hex
        self.wake = asyncio.Event()  # a batch was created or cancelled here
        self._store: BatchStore | None = None
        self._opening = threading.Lock()
        self._lock_file: int | None = None

    def store(self) -> BatchStore:
        """The store, made on first use."""
        with self._opening:
            if self._store is None:
                self._store = BatchStore(self.path)
            return self._store

    def changed(self) -> None:
        """A batch was created or cancelled: look now rather than at the next poll."""
        self.wake.set()

    async def run(self) -> None:
        headers = {BACKGROUND_HEADER: self.token}
        if self.frontend.config.key:
            headers["authorization"] = f"Bearer {self.frontend.config.key}"
        transport = httpx.ASGITransport(app=self.app)
        try:
            async with httpx.AsyncClient(transport=transport, base_url="http://batch",
                                         timeout=None, headers=headers) as http:
                while True:
                    batch = await asyncio.to_thread(self._next)
                    if batch is None:
                        self.wake.clear()
                        try:
                            await asyncio.wait_for(self.wake.wait(), self.poll)
                        except asyncio.TimeoutError:
                            pass
                        continue
                    try:
                        await self._work(http, batch)
                    except Exception:  # noqa: BLE001 - logged; the batch is tried again
                        log.exception("batch %s", batch["id"])
                        await asyncio.sleep(self.poll)
        finally:
            if self._lock_file is not None:
                os.close(self._lock_file)
            if self._store is not None:
                self._store.close()

    def _next(self) -> dict | None:
        """The oldest batch with work left, once this server holds the store's lock (none
        while there is no store)."""
        if self._store is None and not self.path.exists():
            return None
        if self._lock_file is None:
            fd = os.open(f"{self.path}.lock", os.O_CREAT | os.O_RDWR, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:  # another server works through this store
                os.close(fd)
                return None
            self._lock_file = fd
        if time.monotonic() - self._purged > PURGE_EVERY:
            self._purged = time.monotonic()
            if count := self.store().purge():
                log.info("%d expired files deleted", count)
        return self.store().next_active()

    async def _work(self, http: httpx.AsyncClient, batch: dict) -> None:
        store, batch_id = self.store(), batch["id"]
        if batch["status"] == "validating":
            await asyncio.to_thread(store.set_status, batch_id, "in_progress", ("validating",))
        urls = (batch["endpoint"],)
        running: set[asyncio.Task] = set()

        async def one(number: int, text: str) -> None:
            try:
                out = await answer(http, text, number, urls)
            except Exception as exc:  # noqa: BLE001 - the line's answer says what failed
                out = output(custom_id_of(text), 500, None, {"error": {
                    "code": "internal_error", "message": f"{type(exc).__name__}: {exc}"}})
            await asyncio.to_thread(store.answer, batch_id, number, out)

        ending = None
        try:
            for number, text in await asyncio.to_thread(store.unanswered, batch_id):
                ending = await self._room(batch, running)
                if ending is not None:
                    break
                task = asyncio.create_task(one(number, text))
                running.add(task)
                task.add_done_callback(running.discard)
            while running and ending is None:
                await asyncio.wait(running, timeout=self.poll)
                ending = await asyncio.to_thread(self._ending, batch)
        finally:
            for task in running:  # cancelled or expired, or the server is stopping
                task.cancel()
            await asyncio.gather(*running, return_exceptions=True)
        if ending is None and await asyncio.to_thread(store.unanswered, batch_id):
            return  # a line's answer was not kept: the next pass sends it again
        status = ending or "completed"
        await asyncio.to_thread(store.finish, batch_id, status,
                                EXPIRED if status == "expired" else None)
        log.info("batch %s %s", batch_id, status)

    async def _room(self, batch: dict, running: set) -> str | None:
        """Wait until another line may start; how the batch ends instead, if it does."""
        checked = 0.0
        while True:
            if time.monotonic() - checked > self.poll:  # the store, now and then
                ending = await asyncio.to_thread(self._ending, batch)
                if ending is not None:
                    return ending
                checked = time.monotonic()
            most = self.concurrency if self.frontend.live_sequences() == 0 else 1
            if len(running) < most:
                return None
            await asyncio.sleep(0.02)

    def _ending(self, batch: dict) -> str | None:
        """'cancelled' or 'expired' when the batch ends before its lines are done."""
        now = self.store().batch(batch["id"])
        if now is None or now["status"] == "cancelling":
            return "cancelled"
        return "expired" if time.time() > batch["expires_at"] else None
