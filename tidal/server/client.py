"""The frontend's handle on the engine-core process: starts it, sends requests over ZMQ,
and turns the core's token outputs into per-request streams of text updates."""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import tempfile
import time
import uuid
from dataclasses import dataclass

import zmq
import zmq.asyncio

from tidal.core import SamplingParams
from tidal.engine.config import EngineConfig
from tidal.engine.output_processor import OutputProcessor
from tidal.engine.outputs import StepUpdate
from tidal.model.tokenizer import Tokenizer
from tidal.server import messages as m
from tidal.server.core_process import run_core

log = logging.getLogger("tidal.server")


class EngineDeadError(RuntimeError):
    """The engine-core process is gone."""


@dataclass
class Failure:
    """Put on a request's queue instead of an update when it cannot go on."""

    message: str
    dead: bool = False  # the engine core died (HTTP 503) rather than refused (400)


class CoreClient:
    """Starts the core process and multiplexes its outputs onto one asyncio.Queue per
    request (StepUpdate items, or a Failure)."""

    def __init__(self, config: EngineConfig, folder: str, tokenizer: Tokenizer) -> None:
        self.config, self.folder, self.tokenizer = config, folder, tokenizer
        self.outputs = OutputProcessor(tokenizer)
        self.queues: dict[str, asyncio.Queue] = {}
        self.stats: m.Stats | None = None
        self.ready: m.Ready | None = None
        self.dead: str | None = None  # why, once the core is gone
        self.on_update = None  # optional callback(StepUpdate) for metrics
        base = os.path.join(tempfile.gettempdir(), f"tidal-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        self._in_addr, self._out_addr = f"ipc://{base}-in", f"ipc://{base}-out"
        self._ctx = zmq.asyncio.Context()
        self._to_core = self._ctx.socket(zmq.PUSH)
        self._from_core = self._ctx.socket(zmq.PULL)
        self._to_core.bind(self._in_addr)
        self._from_core.bind(self._out_addr)
        self._proc: multiprocessing.process.BaseProcess | None = None
        self._tasks: list[asyncio.Task] = []

    # ------------------------------------------------------------------ lifecycle
    async def start(self, timeout: float = 600.0) -> None:
        spawn = multiprocessing.get_context("spawn")  # no forked torch/asyncio state
        self._proc = spawn.Process(target=run_core, name="tidal-engine-core", daemon=True,
                                   args=(self.config, str(self.folder),
                                         self.tokenizer.eos_token_id, self._in_addr,
                                         self._out_addr))
        self._proc.start()
        t0 = time.monotonic()
        while self.ready is None:
            if not self._proc.is_alive():
                raise EngineDeadError("the engine core exited while starting")
            if time.monotonic() - t0 > timeout:
                raise EngineDeadError("the engine core did not start in time")
            if await self._from_core.poll(200):
                msg = m.from_core.decode(await self._from_core.recv())
                if isinstance(msg, m.Failed):
                    raise EngineDeadError(f"the engine core failed to start: {msg.message}")
                if isinstance(msg, m.Ready):
                    self.ready = msg
        self._tasks = [asyncio.create_task(self._read_loop()),
                       asyncio.create_task(self._watch())]

    async def shutdown(self, drain_timeout: float = 0.0) -> None:
        """Let running requests finish for up to `drain_timeout` s, then stop the core."""
        if self._proc is not None and self._proc.is_alive():
            await self._send(m.Shutdown(drain_timeout))
            deadline = time.monotonic() + drain_timeout + 10
            while self._proc.is_alive() and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            if self._proc.is_alive():
                self._proc.kill()
            self._proc.join(timeout=5)
        self._fail_all("the server is shutting down", dead=True)
        for task in self._tasks:
            task.cancel()
        self._to_core.close(linger=0)
        self._from_core.close(linger=0)
        self._ctx.term()

    @property
    def alive(self) -> bool:
        return self.dead is None and self._proc is not None and self._proc.is_alive()

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    # ------------------------------------------------------------------ requests
    async def add(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                  queue: asyncio.Queue | None = None) -> asyncio.Queue:
        """Send a request to the core; its updates (or a Failure) arrive on `queue`, which
        several requests may share (updates carry their root id)."""
        if not self.alive:
            raise EngineDeadError(self.dead or "the engine core is not running")
        queue = queue if queue is not None else asyncio.Queue()
        self.queues[request_id] = queue
        self.outputs.track(request_id, params)
        await self._send(m.Add(request_id, prompt_token_ids, params, time.time()))
        return queue

    async def abort(self, request_id: str) -> None:
        """The client is gone: forget the request here and free its blocks in the core."""
        self.queues.pop(request_id, None)
        self.outputs.forget(request_id)
        if self.alive:
            await self._send(m.Abort(request_id))

    def release(self, request_id: str) -> None:
        """A finished request's queue is no longer read."""
        self.queues.pop(request_id, None)

    @property
    def num_outstanding(self) -> int:
        return len(self.queues)

    async def _send(self, msg) -> None:
        await self._to_core.send(m.encoder.encode(msg))

    # ------------------------------------------------------------------ outputs
    async def _read_loop(self) -> None:
        while True:
            msg = m.from_core.decode(await self._from_core.recv())
            if isinstance(msg, m.Outputs):
                updates, stopped = self.outputs.process(msg.outputs, msg.logprobs)
                for seq_id in stopped:
                    await self._send(m.Finish(seq_id))
                self._deliver(updates)
            elif isinstance(msg, m.Stats):
                self.stats = msg
            elif isinstance(msg, m.Rejected):
                self.outputs.forget(msg.request_id)
                queue = self.queues.get(msg.request_id)
                if queue is not None:
                    queue.put_nowait(Failure(msg.message))

    def _deliver(self, updates: list[StepUpdate]) -> None:
        for u in updates:
            if self.on_update is not None:
                self.on_update(u)
            queue = self.queues.get(u.root_id)
            if queue is not None:
                queue.put_nowait(u)

    async def _watch(self) -> None:
        """Notice the core process dying: fail what is in flight, refuse what comes."""
        while self._proc is not None and self._proc.is_alive():
            await asyncio.sleep(0.2)
        if self.dead is None:
            code = self._proc.exitcode if self._proc is not None else None
            self.dead = f"the engine core process exited (code {code})"
            log.error("%s; failing %d requests", self.dead, len(self.queues))
            self._fail_all(self.dead, dead=True)

    def _fail_all(self, message: str, dead: bool) -> None:
        for rid, queue in list(self.queues.items()):
            queue.put_nowait(Failure(message, dead=dead))
            self.outputs.forget(rid)
        self.queues.clear()
