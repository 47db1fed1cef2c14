"""The frontend's handle on its engine cores: starts them (local processes or Ray actors),
sends requests over ZMQ (through the data-parallel dispatcher when there are several), and
turns the cores' token outputs into per-request streams of text updates. A core that dies
is started again on the same sockets (core_watch.py)."""

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
from tidal.server.core_watch import CoreWatch, RestartPolicy

log = logging.getLogger("tidal.server")


class EngineDeadError(RuntimeError):
    """The engine-core process is gone (for now: `retry_after` seconds while restarting)."""

    def __init__(self, message: str, retry_after: int | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after


@dataclass
class Failure:
    """Put on a request's queue instead of an update when it cannot go on."""

    message: str
    dead: bool = False  # the engine core died (HTTP 503) rather than refused (400)


class CoreClient:
    """Starts `data_parallel_size` cores and multiplexes their outputs onto one asyncio.Queue
    per request (StepUpdate items, or a Failure). With one core requests go straight to it;
    with several the dispatcher's thread batches and routes them. A dead core fails only the
    requests it held; the others keep serving, and it is restarted under `restart`."""

    def __init__(self, config: EngineConfig, folder: str, tokenizer: Tokenizer,
                 restart: RestartPolicy | None = None) -> None:
        self.config, self.folder, self.tokenizer = config, folder, tokenizer
        self.num_cores = config.parallel.data_parallel_size
        self.outputs = OutputProcessor(tokenizer)
        self.queues: dict[str, asyncio.Queue] = {}
        self.core_stats: list[m.Stats | None] = [None] * self.num_cores
        self.ready: m.Ready | None = None
        self.dead: str | None = None  # why, once every core is gone for good
        self.on_update = None  # optional callback(StepUpdate) for metrics
        self.on_stats = None  # optional callback(Stats) for the dashboard
        self._watching = m.Watch(0)  # what the cores were last told of open dashboards
        self.dispatcher: Dispatcher | None = None
        backend, gpu = config.parallel.dp_backend, config.model.device == "cuda"
        self._new_handle = lambda i: core_handle(backend, i, gpu)
        handles = [self._new_handle(i) for i in range(self.num_cores)]  # Ray: before the host
        self.watch = CoreWatch(self.num_cores, restart or RestartPolicy(), self._launch,
                               self._core_down, self._core_up, self._all_gone, handles)
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
        self._loop: asyncio.AbstractEventLoop | None = None

    # ------------------------------------------------------------------ lifecycle
    async def start(self, timeout: float = 600.0) -> None:
        self._loop = asyncio.get_running_loop()
        self._tasks = [asyncio.create_task(self._read_loop())]
        t0 = time.monotonic()
        try:
            for state in self.watch.cores:
                self.watch.launch(state)
            for state in self.watch.cores:
                left = timeout - (time.monotonic() - t0)
                if not await self.watch.wait_ready(state, left):
                    raise EngineDeadError(f"engine core {state.index}: {state.reason}")
                self.ready = state.ready
        except BaseException:
            for state in self.watch.cores:
                state.handle.kill()
            self._tasks[0].cancel()
            raise
        self.watch.startup_seconds = time.monotonic() - t0
        self.watch.start_timeout = timeout
        if self.num_cores > 1:
            par = self.config.parallel
            self.dispatcher = Dispatcher(
                Router(par.dp_routing, self.num_cores), self._send_routed, self.ready.num_blocks,
                self.ready.block_size, self.config.scheduler.max_input_tokens_per_step,
                par.dp_batch_timeout)
            self.dispatcher.start()
        self._tasks.append(asyncio.create_task(self.watch.run()))

    def _launch(self, index: int, incarnation: int, old):
        """Start core `index` on its sockets: the first handle, or a new one after a death."""
        handle = old
        if handle is None or incarnation > 1:
            if handle is not None:
                handle.kill()  # reaps the dead process (or frees its Ray actor)
            handle = self._new_handle(index)
        handle.start(run_core, (self._core_config(), str(self.folder),
                                self.tokenizer.eos_token_id, self._in_addrs[index],
                                self._out_addr, index, incarnation))
        return handle

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
        self.watch.close()
        if self.dispatcher is not None:
            for item in self.dispatcher.close():  # never sent: nothing to drain
                self._fail(item.request_id, "the server is shutting down", dead=True)
        live = [s.handle for s in self.watch.cores if s.up and s.handle.alive()]
        for h in live:
            self._send_now(h.index, m.Shutdown(drain_timeout))
        deadline = time.monotonic() + drain_timeout + 10
        while any(h.alive() for h in live) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for s in self.watch.cores:  # a core still starting is stopped here too
            if s.handle is not None:
                s.handle.kill()
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
        """Whether a core serves now (requests are taken)."""
        return self.dead is None and self.watch.alive

    def unavailable(self) -> EngineDeadError:
        """Why requests are refused while no core serves: restarting (with when to retry)
        or gone for good."""
        if self.dead is None and self.watch.restarting:
            why = next(s.reason for s in self.watch.cores if s.restarting)
            return EngineDeadError(f"the engine core is restarting after it died ({why}); "
                                   "retry shortly", self.watch.retry_after())
        return EngineDeadError(self.dead or "the engine core is not running")

    @property
    def dead_cores(self) -> dict[int, str]:
        """Cores gone for good, and why."""
        return {s.index: s.reason for s in self.watch.cores if s.gone}

    @property
    def pid(self) -> int | None:
        return self.watch.cores[0].handle.pid

    @property
    def pids(self) -> list[int | None]:
        return [s.handle.pid for s in self.watch.cores]

    @property
    def stats(self) -> m.Stats | None:
        """The serving cores' latest stats, summed (None until every one reported)."""
        got = [self.core_stats[s.index] for s in self.watch.cores if s.up]
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
            raise self.unavailable()
        queue = queue if queue is not None else asyncio.Queue()
        self.queues[request_id] = queue
        self.outputs.track(request_id, params)
        msg = m.Add(request_id, prompt_token_ids, params, time.time(), prefill_address)
        try:
            if self.dispatcher is not None:
                self.dispatcher.submit(msg)
            elif not self._send_now(0, msg):
                raise self.unavailable()
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
        elif self.watch.cores[0].up:
            self._send_now(0, m.Abort(request_id))

    def release(self, request_id: str) -> None:
        """A finished request's queue is no longer read."""
        self.queues.pop(request_id, None)
        self.outputs.forget(request_id)  # its siblings all ended; this drops what remains
        if self.dispatcher is not None:
            self.dispatcher.done(request_id)

    @property
    def num_outstanding(self) -> int:
        return len(self.queues)

    def _send_now(self, core: int, msg) -> bool:
        """Send without blocking; False when no core process is connected to take it."""
        with self._send_lock:
            try:  # the queue is unbounded: only a missing peer makes this fail
                self._to_core[core].send(m.encoder.encode(msg), zmq.NOBLOCK)
                return True
            except zmq.Again:
                return False

    def broadcast(self, msg: m.Watch) -> None:
        """Tell every core (and cores started later) how many dashboards watch."""
        self._watching = msg
        for core in range(self.num_cores):
            self._send_now(core, msg)

    def _send_routed(self, core: int, msg) -> None:
        """The dispatcher thread's send: a request that found its core just gone fails."""
        if not self._send_now(core, msg) and isinstance(msg, m.Add):
            self._loop.call_soon_threadsafe(self._fail, msg.request_id,
                                            f"engine core {core} is not running", True)

    # ------------------------------------------------------------------ outputs
    async def _read_loop(self) -> None:
        while True:
            msg = m.from_core.decode(await self._from_core.recv())
            if isinstance(msg, m.Ready):
                self.watch.on_ready(msg)
            elif isinstance(msg, m.Failed):
                self.watch.on_failed(msg)
            elif isinstance(msg, m.Rejected):
                self._fail(msg.request_id, msg.message, dead=False)
            elif not self.watch.current(msg.core, msg.incarnation):
                continue  # late news from a dead incarnation: its requests were failed
            elif isinstance(msg, m.Outputs):
                updates, stopped = self.outputs.process(msg.outputs, msg.logprobs,
                                                        msg.prompt_logprobs)
                for seq_id in stopped:
                    self._send_now(msg.core, m.Finish(seq_id))
                self._deliver(updates)
            elif isinstance(msg, m.Stats):
                self.core_stats[msg.core] = msg
                if self.on_stats is not None:
                    self.on_stats(msg)
                if self.dispatcher is not None:
                    s = msg.scheduler
                    self.dispatcher.report(msg.core, s.unclaimed_blocks, s.outstanding_tokens,
                                           s.new_token_ratio, msg.adds_seen, s.prefill_tokens)

    def _deliver(self, updates: list[StepUpdate]) -> None:
        for u in updates:
            if self.on_update is not None:
                self.on_update(u)
            queue = self.queues.get(u.root_id)
            if queue is not None:
                queue.put_nowait(u)

    def _core_down(self, core: int, message: str) -> None:
        """Core `core` died: fail the requests it held (with one core, every request)."""
        self.core_stats[core] = None
        lost = self.dispatcher.core_died(core) if self.dispatcher is not None else list(self.queues)
        log.error("%s; failing its %d requests", message, len(lost))
        for rid in lost:
            self._fail(rid, message, dead=True)

    def _core_up(self, core: int, ready: m.Ready) -> None:
        """Core `core` is back: its Ready (a P/D core's new KV address) and its routing."""
        self.ready = ready
        if self._watching.viewers:
            self._send_now(core, self._watching)
        if self.dispatcher is not None:
            self.dispatcher.core_rejoined(core)

    def _all_gone(self, reason: str) -> None:
        """No core serves, nor will: refuse new requests and fail the rest."""
        self.dead = reason
        log.error("%s; failing %d requests", reason, len(self.queues))
        if self.dispatcher is not None:
            self.dispatcher.close()
        self._fail_all(reason, dead=True)

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
