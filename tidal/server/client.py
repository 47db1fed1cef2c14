"""The frontend's handle on its engine cores: starts them (local processes or Ray actors),
sends requests over ZMQ (through the data-parallel dispatcher when there are several), and
turns the cores' token outputs into per-request streams of text updates."""

from __future__ import annotations

import asyncio
import logging
import os
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, fields, replace

import zmq
import zmq.asyncio

from tidal.cluster.dispatcher import Dispatcher
from tidal.cluster.launch import core_handle, frontend_host
from tidal.cluster.routing import Router
from tidal.core import SamplingParams
from tidal.core.invariants import SchedulerStats
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
    """Starts `data_parallel_size` cores and multiplexes their outputs onto one asyncio.Queue
    per request (StepUpdate items, or a Failure). With one core requests go straight to it;
    with several the dispatcher's thread batches and routes them. A dead core fails only the
    requests it held; the others keep serving."""

    def __init__(self, config: EngineConfig, folder: str, tokenizer: Tokenizer) -> None:
        self.config, self.folder, self.tokenizer = config, folder, tokenizer
        self.num_cores = config.parallel.data_parallel_size
        self.outputs = OutputProcessor(tokenizer)
        self.queues: dict[str, asyncio.Queue] = {}
        self.core_stats: list[m.Stats | None] = [None] * self.num_cores
        self.ready: m.Ready | None = None
        self.dead: str | None = None  # why, once every core is gone
        self.dead_cores: dict[int, str] = {}
        self.on_update = None  # optional callback(StepUpdate) for metrics
        self.dispatcher: Dispatcher | None = None
        backend, gpu = config.parallel.dp_backend, config.model.device == "cuda"
        self._handles = [core_handle(backend, i, gpu) for i in range(self.num_cores)]
        host = frontend_host(backend)
        base = os.path.join(tempfile.gettempdir(), f"tidal-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        # Sends are synchronous (the dispatcher thread sends too) and serialised by a lock.
        self._sync_ctx, self._ctx = zmq.Context(), zmq.asyncio.Context()
        self._send_lock = threading.Lock()
        self._to_core, self._in_addrs = [], []
        for i in range(self.num_cores):
            sock = self._sync_ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.SNDHWM, 0)  # queue rather than block the event loop
            self._in_addrs.append(_bind(sock, host, f"{base}-in{i}"))
            self._to_core.append(sock)
        self._from_core = self._ctx.socket(zmq.PULL)
        self._out_addr = _bind(self._from_core, host, f"{base}-out")
        self._tasks: list[asyncio.Task] = []

    # ------------------------------------------------------------------ lifecycle
    async def start(self, timeout: float = 600.0) -> None:
        eos = self.tokenizer.eos_token_id
        for i, handle in enumerate(self._handles):
            handle.start(run_core, (self._core_config(), str(self.folder), eos,
                                    self._in_addrs[i], self._out_addr, i))
        t0, ready = time.monotonic(), set()
        try:
            while len(ready) < self.num_cores:
                dead = [h for h in self._handles if h.index not in ready and not h.alive()]
                if dead:
                    raise EngineDeadError(f"engine core {dead[0].index} exited while starting")
                if time.monotonic() - t0 > timeout:
                    raise EngineDeadError("the engine cores did not start in time")
                if await self._from_core.poll(200):
                    msg = m.from_core.decode(await self._from_core.recv())
                    if isinstance(msg, m.Failed):
                        raise EngineDeadError(f"the engine core failed to start: {msg.message}")
                    if isinstance(msg, m.Stats):
                        self.core_stats[msg.core] = msg
                    if isinstance(msg, m.Ready):
                        ready.add(msg.core)
                        self.ready = msg
        except BaseException:
            for handle in self._handles:
                handle.kill()
            raise
        if self.num_cores > 1:
            par = self.config.parallel
            self.dispatcher = Dispatcher(
                Router(par.dp_routing, self.num_cores), self._send_now, self.ready.num_blocks,
                self.ready.block_size, self.config.scheduler.max_input_tokens_per_step,
                par.dp_batch_timeout)
            self.dispatcher.start()
        self._tasks = [asyncio.create_task(self._read_loop()),
                       asyncio.create_task(self._watch())]

    def _core_config(self) -> EngineConfig:
        """Data-parallel cores on one CPU share its cores unless told otherwise."""
        config = self.config  # frozen: a core that needs other values gets a new one
        if (self.num_cores > 1 and config.model.num_threads is None
                and config.model.device != "cuda"):
            threads = max(1, len(os.sched_getaffinity(0)) // self.num_cores)
            config = replace(config, model=replace(config.model, num_threads=threads))
        return config

    async def shutdown(self, drain_timeout: float = 0.0) -> None:
        """Let running requests finish for up to `drain_timeout` s, then stop the cores."""
        if self.dispatcher is not None:
            for item in self.dispatcher.close():  # never sent: nothing to drain
                self._fail(item.request_id, "the server is shutting down", dead=True)
        live = [h for h in self._handles if h.alive()]
        for h in live:
            self._send_now(h.index, m.Shutdown(drain_timeout))
        deadline = time.monotonic() + drain_timeout + 10
        while any(h.alive() for h in live) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for h in self._handles:
            h.kill()
        self._fail_all("the server is shutting down", dead=True)
        for task in self._tasks:
            task.cancel()
        for sock in self._to_core:
            sock.close(linger=0)
        self._from_core.close(linger=0)
        self._sync_ctx.term()
        self._ctx.term()

    @property
    def alive(self) -> bool:
        return self.dead is None and any(h.alive() for h in self._handles)

    @property
    def pid(self) -> int | None:
        return self._handles[0].pid

    @property
    def pids(self) -> list[int | None]:
        return [h.pid for h in self._handles]

    @property
    def stats(self) -> m.Stats | None:
        """The cores' latest stats, summed (None until every live core reported)."""
        got = [s for i, s in enumerate(self.core_stats) if i not in self.dead_cores]
        if not got or any(s is None for s in got):
            return None
        return got[0] if len(got) == 1 else _merge(got)

    # ------------------------------------------------------------------ requests
    async def add(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                  queue: asyncio.Queue | None = None,
                  prefill_address: str | None = None) -> asyncio.Queue:
        """Send a request to a core; its updates (or a Failure) arrive on `queue`, which
        several requests may share (updates carry their root id). A decode instance gets
        the prefill core that computes the prompt (`prefill_address`, from the router)."""
        if not self.alive:
            raise EngineDeadError(self.dead or "the engine core is not running")
        queue = queue if queue is not None else asyncio.Queue()
        self.queues[request_id] = queue
        self.outputs.track(request_id, params)
        msg = m.Add(request_id, prompt_token_ids, params, time.time(), prefill_address)
        try:
            if self.dispatcher is not None:
                self.dispatcher.submit(msg)
            else:
                self._send_now(0, msg)
        except Exception:  # nothing was sent: forget the request, or it counts forever
            self.queues.pop(request_id, None)
            self.outputs.forget(request_id)
            raise
        return queue

    async def abort(self, request_id: str) -> None:
        """The client is gone: forget the request here and free its blocks in the core."""
        self.queues.pop(request_id, None)
        self.outputs.forget(request_id)
        if self.dispatcher is not None:
            self.dispatcher.abort(request_id, m.Abort(request_id))
        elif self.alive:
            self._send_now(0, m.Abort(request_id))

    def release(self, request_id: str) -> None:
        """A finished request's queue is no longer read."""
        self.queues.pop(request_id, None)
        if self.dispatcher is not None:
            self.dispatcher.done(request_id)

    @property
    def num_outstanding(self) -> int:
        return len(self.queues)

    def _send_now(self, core: int, msg) -> None:
        with self._send_lock:
            self._to_core[core].send(m.encoder.encode(msg))

    # ------------------------------------------------------------------ outputs
    async def _read_loop(self) -> None:
        while True:
            msg = m.from_core.decode(await self._from_core.recv())
            if isinstance(msg, m.Outputs):
                updates, stopped = self.outputs.process(msg.outputs, msg.logprobs)
                for seq_id in stopped:
                    self._send_now(msg.core, m.Finish(seq_id))
                self._deliver(updates)
            elif isinstance(msg, m.Stats):
                self.core_stats[msg.core] = msg
                if self.dispatcher is not None:
                    s = msg.scheduler
                    self.dispatcher.report(msg.core, s.unclaimed_blocks, s.outstanding_tokens,
                                           s.new_token_ratio, msg.adds_seen)
            elif isinstance(msg, m.Rejected):
                self._fail(msg.request_id, msg.message, dead=False)

    def _deliver(self, updates: list[StepUpdate]) -> None:
        for u in updates:
            if self.on_update is not None:
                self.on_update(u)
            queue = self.queues.get(u.root_id)
            if queue is not None:
                queue.put_nowait(u)

    async def _watch(self) -> None:
        """Notice cores dying: fail the requests each held; once none is left, refuse new
        ones and fail the rest."""
        while len(self.dead_cores) < self.num_cores:
            await asyncio.sleep(0.2)
            for h in self._handles:
                if h.index in self.dead_cores or h.alive():
                    continue
                reason = h.exit_reason()
                self.dead_cores[h.index] = reason
                if self.dispatcher is None:
                    continue
                lost = self.dispatcher.core_died(h.index)
                log.error("engine core %d: %s; failing its %d requests", h.index, reason,
                          len(lost))
                for rid in lost:
                    self._fail(rid, f"engine core {h.index}: {reason}", dead=True)
        if self.dead is None:
            self.dead = next(iter(self.dead_cores.values()))
            log.error("%s; failing %d requests", self.dead, len(self.queues))
            if self.dispatcher is not None:
                self.dispatcher.close()
            self._fail_all(self.dead, dead=True)

    def _fail(self, request_id: str, message: str, dead: bool) -> None:
        self.outputs.forget(request_id)
        queue = self.queues.pop(request_id, None)
        if queue is not None:
            queue.put_nowait(Failure(message, dead=dead))

    def _fail_all(self, message: str, dead: bool) -> None:
        for rid in list(self.queues):
            self._fail(rid, message, dead)


def _bind(sock: zmq.Socket, host: str | None, path: str) -> str:
    """Bind to an ipc path (local cores) or a free TCP port on `host` (Ray actors)."""
    if host is None:
        sock.bind(f"ipc://{path}")
        return f"ipc://{path}"
    return f"tcp://{host}:{sock.bind_to_random_port(f'tcp://{host}')}"


def _merge(stats: list[m.Stats]) -> m.Stats:
    """Data-parallel cores' stats as one engine's: counts summed, shares recomputed."""
    total = {f.name: sum(getattr(s.scheduler, f.name) for s in stats)
             for f in fields(SchedulerStats)}
    total["kv_usage"] = total["used_blocks"] / max(1, total["num_blocks"])
    total["prefix_hit_rate"] = total["prefix_hit_tokens"] / max(1, total["prefix_query_tokens"])
    total["new_token_ratio"] /= len(stats)
    total["num_steps"] = max(s.scheduler.num_steps for s in stats)
    return m.Stats(-1, sum(s.adds_seen for s in stats), SchedulerStats(**total),
                   sum(s.prompt_tokens for s in stats), sum(s.generation_tokens for s in stats),
                   sum(s.execute_seconds for s in stats), sum(s.step_seconds for s in stats))
