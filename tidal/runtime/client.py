"""The frontend's handle on its engine cores: starts them (local processes or Ray actors) and
supervises them across deaths and restarts (core_watch.py), sends requests over ZMQ
(transport.py; through the data-parallel dispatcher when there are several cores), and reads
the cores' messages: token outputs onto per-request streams (streams.py), stats onto one
board (core_stats.py)."""

from __future__ import annotations

import asyncio
import logging
import os
import time
from dataclasses import replace
from typing import Callable

from tidal.cluster.dispatcher import Dispatcher
from tidal.cluster.launch import core_handle, frontend_host
from tidal.cluster.routing import Router
from tidal.core import SamplingParams
from tidal.engine import messages as m
from tidal.engine.config import EngineConfig
from tidal.engine.parallel_config import busy_ranks
from tidal.model.tokenizer import Tokenizer
from tidal.runtime.core_process import run_core
from tidal.runtime.core_stats import CoreStatsBoard
from tidal.runtime.core_watch import CoreWatch, RestartPolicy
from tidal.runtime.streams import Failure, RequestStreams
from tidal.runtime.transport import CoreSockets

__all__ = ["CoreClient", "EngineDeadError", "Failure"]

log = logging.getLogger("tidal.server")


class EngineDeadError(RuntimeError):
    """The engine-core process is gone (for now: `retry_after` seconds while restarting)."""

    def __init__(self, message: str, retry_after: int | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after


def core_config(config: EngineConfig, cores: int) -> EngineConfig:
    """The config each engine core starts with: data-parallel cores on one CPU of `cores`
    share them unless told otherwise, and so do the tensor-parallel ranks of each."""
    dp = config.parallel.data_parallel_size
    if dp > 1 and config.model.num_threads is None and config.model.device != "cuda":
        parallel = config.parallel
        busy = busy_ranks(parallel.local_ranks, parallel.tensor_parallel_size,
                          config.scheduler.steps_in_flight)
        threads = max(1, cores // (dp * busy))
        config = replace(config, model=replace(config.model, num_threads=threads))
    return config  # frozen: a core that needs other values gets a new one


class CoreClient:
    """Starts `data_parallel_size` cores and multiplexes their outputs onto one asyncio.Queue
    per request (StepUpdate items, or a Failure). With one core requests go straight to it;
    with several the dispatcher's thread batches and routes them. A dead core fails only the
    requests it held; the others keep serving, and it is restarted under `restart`."""

    def __init__(self, config: EngineConfig, folder: str, tokenizer: Tokenizer | None,
                 restart: RestartPolicy | None = None, files_pending: bool = False) -> None:
        """`tokenizer` None: `folder` is a GGUF's, whose tokenizer this process reads while
        the cores load (`attach_tokenizer` comes before `start`); `files_pending`: its files
        are still being written, and the cores launched meanwhile wait for them."""
        self.config, self.folder, self.tokenizer = config, folder, None
        self.files_pending = files_pending
        self.num_cores = config.parallel.data_parallel_size
        if tokenizer is not None:
            self.attach_tokenizer(tokenizer)
        self.board = CoreStatsBoard(self.num_cores)
        self.ready: m.Ready | None = None
        self.dead: str | None = None  # why, once every core is gone for good
        self.last_output = 0.0  # when (time.monotonic) a core last sent tokens
        self.on_stats: Callable[[m.Stats], None] | None = None  # e.g. the dashboard
        self._watching = m.Watch(0)  # what the cores were last told of open dashboards
        self.adapters = dict(config.lora.modules)  # the LoRA adapters the cores serve
        self.dispatcher: Dispatcher | None = None
        backend, gpu = config.parallel.dp_backend, config.model.device == "cuda"
        self._new_handle = lambda i: core_handle(backend, i, gpu)
        handles = [self._new_handle(i) for i in range(self.num_cores)]  # Ray: before the host
        self.watch = CoreWatch(self.num_cores, restart or RestartPolicy(), self._launch,
                               self._core_down, self._core_up, self._all_gone, handles)
        self.sockets = CoreSockets(self.num_cores, frontend_host(backend))
        self._tasks: list[asyncio.Task] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._launched: float | None = None  # when the cores were launched
        self.holds: set[str] = set()  # why new requests wait unsent (see `hold`)
        self.stopping = False  # the server stops: requests held are refused
        self.cores_paused = False  # paused in the cores too (mode keep): they plan no step
        self.asleep: list = []  # the cores `sleep` stopped, to start at `wake`
        self.weights_lock = asyncio.Lock()  # one weight update, sleep or wake at a time
        self.weight_version = "default"  # what the last weight update named it

    # ------------------------------------------------------------------ lifecycle
    def attach_tokenizer(self, tokenizer: Tokenizer) -> None:
        self.tokenizer, self.streams = tokenizer, RequestStreams(tokenizer)

    def launch(self) -> None:
        """Start the engine cores now; `start` waits for them. `tidal serve` launches them
        before it imports and builds the HTTP app, so the two load side by side."""
        if self._launched is None:
            self._launched = time.monotonic()
            for state in self.watch.cores:
                self.watch.launch(state)

    async def start(self, timeout: float = 600.0) -> None:
        self._loop = asyncio.get_running_loop()
        self._tasks = [asyncio.create_task(self._read_loop())]
        try:
            self.launch()
            t0 = self._launched
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
        log.info("engine core%s ready in %.2fs", "s" if self.num_cores > 1 else "",
                 self.watch.startup_seconds)
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
        # No tokenizer yet: the core reads its end token from the model's config.
        eos = self.tokenizer.eos_token_id if self.tokenizer is not None else None
        handle.start(run_core, (self._core_config(), str(self.folder), eos,
                                self.sockets.in_addrs[index], self.sockets.out_addr, index,
                                incarnation, self.files_pending and self.tokenizer is None))
        return handle

    def _core_config(self) -> EngineConfig:
        return core_config(self.config, len(os.sched_getaffinity(0)))

    async def shutdown(self, drain_timeout: float = 0.0) -> None:
        """Let running requests finish for up to `drain_timeout` s, then stop the cores."""
        self.watch.close()
        self._end_holds()
        if self.dispatcher is not None:
            for item in self.dispatcher.close():  # never sent: nothing to drain
                self.streams.fail(item.request_id, "the server is shutting down", dead=True)
        live = [s.handle for s in self.watch.cores if s.up and s.handle.alive()]
        for h in live:
            self.sockets.send(h.index, m.Shutdown(drain_timeout))
        deadline = time.monotonic() + drain_timeout + 10
        while any(h.alive() for h in live) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for s in self.watch.cores:  # a core still starting is stopped here too
            if s.handle is not None:
                s.handle.kill()
        self.streams.fail_all("the server is shutting down", dead=True)
        for task in self._tasks:
            task.cancel()
        self.sockets.close()

    @property
    def alive(self) -> bool:
        """Whether a core serves now (requests are taken), or will once a weight update or
        a wake has started the cores (requests wait meanwhile, none fail)."""
        stopped = bool(self.holds & {"sleep", "update"})  # on purpose, to start again
        return self.dead is None and (self.watch.alive or stopped)

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
        return self.board.merged([s.index for s in self.watch.cores if s.up])

    # ------------------------------------------------------------------ requests
    async def add(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                  queue: asyncio.Queue | None = None,
                  prefill_address: str | None = None) -> asyncio.Queue:
        """Send a request to a core; its updates (or a Failure) arrive on `queue`, which
        several requests may share (updates carry their root id). A decode instance gets
        the prefill core that computes the prompt (`prefill_address`, from the router).
        While a hold is on (paused, asleep, weights updating) it is opened but held unsent
        until the hold lifts: it can be aborted, or stopped by name, meanwhile."""
        if self.stopping:
            raise EngineDeadError("the server is shutting down")
        if not self.alive:
            raise self.unavailable()
        queue = self.streams.open(request_id, params, queue)
        msg = m.Add(request_id, prompt_token_ids, params, time.time(), prefill_address)
        if self.holds:
            self.streams.hold(msg)
            return queue
        try:
            self._send(msg)
        except Exception:  # nothing was sent: forget the request, or it counts forever
            self.streams.close(request_id)
            raise
        return queue

    def _send(self, msg: m.Add) -> None:
        if self.dispatcher is not None:
            self.dispatcher.submit(msg)
        elif not self.sockets.send(0, msg):
            raise self.unavailable()

    def _send_held(self) -> None:
        """The requests held while a hold was on go on, in the order they came (their
        arrival is now: the cores saw none of their wait)."""
        for msg in self.streams.take_held():
            msg.arrival_time = time.time()
            try:
                if not self.alive:
                    raise self.unavailable()
                self._send(msg)
            except EngineDeadError as exc:
                self.streams.fail(msg.request_id, str(exc), dead=True)

    async def abort(self, request_id: str) -> None:
        """The client is gone: forget the request here and free its blocks in the core."""
        sent = request_id not in self.streams.held
        self.streams.close(request_id)
        if not sent:
            return
        if self.dispatcher is not None:
            self.dispatcher.abort(request_id)
        elif self.watch.cores[0].up:
            self.sockets.send(0, m.Abort(request_id))

    async def stop(self, request_id: str, message: str) -> None:
        """End a request now, answered: its unfinished sequences finish with reason `abort`
        and the text they have (SGLang's /abort_request); its blocks are freed in the core."""
        sent = request_id not in self.streams.held
        self.streams.end(request_id, "abort", message)
        if sent:
            await self.abort(request_id)

    def release(self, request_id: str) -> None:
        """A finished request's queue is no longer read."""
        self.streams.close(request_id)  # its siblings all ended; this drops what remains
        if self.dispatcher is not None:
            self.dispatcher.done(request_id)

    @property
    def num_outstanding(self) -> int:
        """Sequences in flight: each open request's n."""
        return self.streams.num_sequences

    def broadcast(self, msg: m.Watch) -> None:
        """Tell every core (and cores started later) how many dashboards watch."""
        self._watching = msg
        self.tell_cores(msg)

    def tell_cores(self, msg) -> None:
        """Send a control message to every core (one that is down misses it)."""
        for core in range(self.num_cores):
            self.sockets.send(core, msg)

    def profile(self, num_steps: int | None) -> None:
        """Start every core's torch.profiler trace (of `num_steps` steps; 0: until the
        next call), or with None stop and write them (`--profiler-dir`)."""
        self.tell_cores(m.StopProfile() if num_steps is None else m.StartProfile(num_steps))

    def set_adapters(self, adapters: dict[str, str]) -> None:
        """Tell every core (and cores restarted later) which LoRA adapters to serve."""
        self.adapters = adapters
        self.tell_cores(m.Adapters(adapters))

    def reset_prefix_cache(self) -> None:
        """Tell every core to forget its cached prefixes (and the dispatcher what it knew
        of them)."""
        if self.dispatcher is not None:
            self.dispatcher.forget_prefixes()
        self.tell_cores(m.ResetPrefixCache())

    # ------------------------------------------------------------------ holding requests
    def hold(self, why: str) -> None:
        """Hold new requests unsent (see `add`) until every hold is lifted: "pause",
        "sleep" or "update" (a weight update)."""
        self.holds.add(why)

    def lift(self, why: str) -> None:
        """Lift one hold; with none left, the held requests go on in the order they came."""
        self.holds.discard(why)
        if not self.holds and not self.stopping:
            self._send_held()

    def stop_holding(self) -> None:
        """The server is stopping (a signal, before its drain): refuse the requests a hold
        keeps now rather than when the drain ends. Safe from a signal handler."""
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._end_holds)

    def _end_holds(self) -> None:
        self.stopping = True
        for msg in self.streams.take_held():
            self.streams.fail(msg.request_id, "the server is shutting down", dead=True)

    @property
    def paused(self) -> bool:
        return "pause" in self.holds

    @property
    def held_in_place(self) -> bool:
        """Whether cores paused in place hold requests (which cannot finish until resumed)."""
        return self.cores_paused and self.streams.num_sent > 0

    def pause(self, cores: bool) -> None:
        """Hold new requests until `resume` (those in flight go on); with `cores`, the cores
        also stop planning steps, and the requests in them wait where they are."""
        self.hold("pause")
        if cores and not self.cores_paused:
            self.cores_paused = True
            self.tell_cores(m.Pause())

    def resume(self) -> None:
        """Let the cores step again and the held requests through."""
        if self.cores_paused:
            self.cores_paused = False
            self.tell_cores(m.Resume())
        self.lift("pause")

    def sleep(self) -> None:
        """Stop every serving core (nothing in flight: the caller drained them and holds
        "sleep"): their memory returns to the machine until `wake`."""
        self.asleep = [s for s in self.watch.cores if s.up]
        for state in self.asleep:
            self.watch.stop(state)
        log.info("asleep: %d engine cores stopped", len(self.asleep))

    async def wake(self) -> str | None:
        """Start the cores `sleep` stopped, then lift its hold; None, or why one did not
        start (it is restarted under the restart policy)."""
        cores, self.asleep = self.asleep, []
        why = await self._start_cores(cores, on_failure=self.watch.died)
        self.lift("sleep")
        return why

    async def swap_weights(self, folder: str, model: str) -> str | None:
        """Serve `model`'s weights from `folder` (the served model's shape: the caller
        checked): every core is stopped and started on them while nothing is in flight
        (the caller drained the requests and holds "update"). None, or why not: then the
        old weights serve again."""
        old, serving = (self.config, self.folder), [s for s in self.watch.cores if s.up]
        self.config = replace(self.config, model=replace(self.config.model, model=model))
        self.folder = folder
        for state in serving:
            self.watch.stop(state)
        why = await self._start_cores(serving)
        if why is not None:
            log.error("weight update failed (%s); loading the old weights again", why)
            self.config, self.folder = old
            for state in serving:
                if state.up:
                    self.watch.stop(state)
            await self._start_cores(serving, on_failure=self.watch.died)
        else:
            log.info("serving the weights of %s", folder)
        return why

    async def _start_cores(self, cores: list, on_failure: Callable | None = None
                           ) -> str | None:
        """Start each of `cores` (stopped) on this client's folder; why the first that did
        not start failed (`on_failure` then gets each such core's state; without it the
        rest are left stopped)."""
        why = None
        if self.dispatcher is not None:
            self.dispatcher.forget_prefixes()  # new cores hold none
        for state in cores:
            if not await self.watch.start(state):
                why = why or f"engine core {state.index}: {state.reason}"
                if on_failure is None:
                    return why
                on_failure(state)
        return why

    async def drained(self) -> None:
        """Return once no request sent to the cores is in flight (held ones wait on)."""
        while self.streams.num_sent:
            await asyncio.sleep(0.02)

    def _send_routed(self, core: int, msg: m.Add | m.Abort) -> bool:
        """The dispatcher thread's send; False where the core is gone (the dispatcher
        routes the request to another)."""
        return self.sockets.send(core, msg)

    # ------------------------------------------------------------------ from the cores
    async def _read_loop(self) -> None:
        while True:
            msg = await self.sockets.recv()
            if isinstance(msg, m.Ready):
                self.watch.on_ready(msg)
            elif isinstance(msg, m.Failed):
                self.watch.on_failed(msg)
            elif isinstance(msg, m.Rejected):
                self.streams.fail(msg.request_id, msg.message, dead=False)
            elif not self.watch.current(msg.core, msg.incarnation):
                continue  # late news from a dead incarnation: its requests were failed
            elif isinstance(msg, m.Heartbeat):
                self.watch.heard(msg.core)
            elif isinstance(msg, m.Outputs):
                self.last_output = time.monotonic()
                for seq_id in self.streams.deliver(msg):
                    self.sockets.send(msg.core, m.Finish(seq_id))
            elif isinstance(msg, m.Stats):
                self.board.record(msg)
                if self.on_stats is not None:
                    self.on_stats(msg)
                if self.dispatcher is not None:
                    s = msg.scheduler
                    self.dispatcher.report(msg.core, s.unclaimed_blocks, s.outstanding_tokens,
                                           s.new_token_ratio, msg.adds_seen, s.prefill_tokens)

    def _core_down(self, core: int, message: str) -> None:
        """Core `core` died: fail the requests it held (with one core, every request); under
        data parallelism those with no output yet go to a live core instead."""
        self.board.clear(core)
        lost = self.dispatcher.core_died(core, self.streams.begun.__contains__) \
            if self.dispatcher is not None else self.streams.sent_ids()
        log.error("%s; failing its %d requests", message, len(lost))
        for rid in lost:
            self.streams.fail(rid, message, dead=True)

    def _core_up(self, core: int, ready: m.Ready) -> None:
        """Core `core` is back: its Ready (a P/D core's new KV address) and its routing."""
        self.ready = ready
        if self._watching.viewers:
            self.sockets.send(core, self._watching)
        if self.adapters != dict(self.config.lora.modules):  # it started with those
            self.sockets.send(core, m.Adapters(self.adapters))
        if self.cores_paused:
            self.sockets.send(core, m.Pause())
        if self.dispatcher is not None:
            self.dispatcher.core_rejoined(core)

    def _all_gone(self, reason: str) -> None:
        """No core serves, nor will: refuse new requests and fail the rest."""
        self.dead = reason
        log.error("%s; failing %d requests", reason, len(self.streams))
        if self.dispatcher is not None:
            self.dispatcher.close()
        self.streams.fail_all(reason, dead=True)
