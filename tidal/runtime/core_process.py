"""The engine-core process: receives requests over ZMQ, steps the engine core, sends token
outputs and stats back, and logs a status line each second while busy."""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from typing import TYPE_CHECKING

import zmq

from tidal.cluster.kv_transfer import KVLink
from tidal.core import RequestOutput
from tidal.core.snapshot import SchedulerView, scheduler_view
from tidal.engine import messages as m
from tidal.engine.config import EngineConfig

if TYPE_CHECKING:
    from tidal.engine.core import EngineCore

log = logging.getLogger("tidal.core")

# Seconds without work before the core times a shape of its step-time profile.
PROFILE_AFTER_IDLE_S = 3.0


class StatusLine:
    """One log line a second while the core has work: queues, KV, prefix hits, the decode
    reservation ratio and the tokens/s of prefill and decode since the last line."""

    def __init__(self, core: EngineCore, interval: float = 1.0) -> None:
        self.core, self.interval = core, interval
        self.last = time.monotonic()
        self.last_prompt, self.last_gen = core.prompt_tokens, core.generation_tokens

    def maybe_log(self) -> None:
        now = time.monotonic()
        if not self.interval or now - self.last < self.interval:
            return
        c, s = self.core, self.core.scheduler.stats()
        dt = now - self.last
        prefill_rate = (c.prompt_tokens - self.last_prompt) / dt
        decode_rate = (c.generation_tokens - self.last_gen) / dt
        log.info("running-decode %d, running-prefill %d, waiting %d, preempted %d, KV %.1f%%, "
                 "prefix hit %.1f%%, new_token_ratio %.3f, prefill %.1f tok/s, decode %.1f tok/s",
                 s.running_decode, s.running_prefill, s.waiting, s.preempted, 100 * s.kv_usage,
                 100 * s.prefix_hit_rate, s.new_token_ratio, prefill_rate, decode_rate)
        if s.spec_drafts:
            log.info("speculation: %d verifications, %d of %d guesses accepted (%.1f%%), "
                     "%.2f tokens per verification", s.spec_drafts, s.spec_accepted_tokens,
                     s.spec_draft_tokens, 100 * s.spec_accepted_tokens / s.spec_draft_tokens,
                     1 + s.spec_accepted_tokens / s.spec_drafts)
        self.last, self.last_prompt, self.last_gen = now, c.prompt_tokens, c.generation_tokens


def run_core(config: EngineConfig, folder: str, eos_token_id: int | None, in_addr: str,
             out_addr: str, index: int = 0, incarnation: int = 0,
             files_pending: bool = False) -> None:
    """The process's main: build the core, say Ready, then serve until Shutdown or until the
    frontend process is gone. `index` names this core among data-parallel ones;
    `incarnation` which start of it this is (every message says so). `files_pending`: the
    frontend is still converting the GGUF into `folder`; import the engine meanwhile and
    wait for the files. `eos_token_id` None: take it from the model's config (a GGUF's
    tokenizer and config take it from one field)."""
    # The engine (torch, the model) is imported here, in the core's own process: the
    # frontend that hands this function to it never loads torch.
    from tidal.engine.core import EngineCore
    from tidal.engine.device import core_device

    logging.basicConfig(level=config.model.log_level.upper(),
                        format="%(asctime)s %(name)s: %(message)s")
    parent = os.getppid()
    if files_pending:
        from tidal.model.registry import files_written

        waited = time.perf_counter()
        while not files_written(folder):
            if os.getppid() != parent:
                return  # the conversion failed and the frontend exited
            time.sleep(0.02)
        log.info("engine imported; waited %.2fs for the model files",
                 time.perf_counter() - waited)
    ctx = zmq.Context()
    inbox, outbox = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    inbox.connect(in_addr)
    outbox.connect(out_addr)
    outbox.setsockopt(zmq.LINGER, 2000)
    link = None
    try:
        device = core_device(config.model.device, index)  # several GPUs: one core each
        core = EngineCore(replace(config, model=replace(config.model, device=device)), folder,
                          eos_token_id)
        if core.scheduler.role.transfers_kv:  # P/D: this core's end of the KV transfer
            link = KVLink(core, ctx, config.parallel.kv_host, config.parallel.kv_transfer_timeout)
    except Exception as exc:  # tell the frontend why instead of dying silently
        log.exception("engine core failed to start")
        outbox.send(m.encoder.encode(m.Failed(f"{type(exc).__name__}: {exc}", index,
                                              incarnation)))
        outbox.close()
        ctx.term()
        return
    # Stats before Ready: the frontend's gauges exist from its first scrape on.
    outbox.send(m.encoder.encode(m.Stats(index, 0, core.scheduler.stats(), 0, 0,
                                         incarnation=incarnation,
                                         max_step_ms=core.step_target_ms())))
    outbox.send(m.encoder.encode(m.Ready(index, core.max_model_len, core.vocab_size,
                                         core.executor.info.num_blocks, config.cache.block_size,
                                         link.address if link else "", incarnation,
                                         core.executor.info.arch.hidden_size,
                                         core.executor.info.matryoshka,
                                         core.executor.info.kv_cache_bytes
                                         // (core.executor.info.num_blocks + 1),
                                         core.executor.info.scorer,
                                         list(core.executor.info.labels))))
    stop = threading.Event()
    threading.Thread(target=_heartbeat, args=(ctx, out_addr, index, incarnation, stop),
                     name="tidal-heartbeat", daemon=True).start()
    try:
        _CoreLoop(core, inbox, outbox, link, index, incarnation).run(parent)
    finally:
        stop.set()
        core.close()
        if link is not None:
            link.close()
        inbox.close(linger=0)
        outbox.close()
        ctx.term()


def _heartbeat(ctx: zmq.Context, out_addr: str, index: int, incarnation: int,
               stop: threading.Event) -> None:
    """Say twice a second that the process lives, on a socket of its own (a ZMQ socket
    serves one thread): the frontend's watchdog kills a core that falls silent (stopped),
    while a long step, which holds the loop, is no silence."""
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(out_addr)
    beat = m.encoder.encode(m.Heartbeat(index, incarnation))
    while not stop.wait(0.5):
        with contextlib.suppress(zmq.ZMQError):
            sock.send(beat, zmq.NOBLOCK)
    sock.close()


class _CoreLoop:
    """Take the frontend's messages (and KV transfers), step, send outputs and stats."""

    def __init__(self, core: EngineCore, inbox: zmq.Socket, outbox: zmq.Socket,
                 link: KVLink | None, index: int, incarnation: int = 0) -> None:
        self.core, self.inbox, self.outbox, self.link, self.index = core, inbox, outbox, link, index
        self.incarnation = incarnation
        self.deadline: float | None = None  # set by Shutdown: drain until then
        self.last_stats = 0.0
        self.last_view = 0.0  # the scheduler clock of the last view sent
        self.viewers = 0  # dashboards watching, as the frontend last said
        self.adds_seen = 0
        self.step_seconds = 0.0  # wall time of steps, their outputs sent, since start
        self.poller = zmq.Poller()
        self.polled: set[zmq.Socket] = set()
        # Requests whose output constraint compiles on a worker thread, kept out of the
        # scheduler until it has: a large or slow grammar never stalls the step loop.
        self.compiling: dict[str, tuple[Future, m.Add]] = {}
        self.compiler = ThreadPoolExecutor(1, "tidal-compile")
        self.busy_at = time.monotonic()  # when the core last had work
        # messages taken during a step (`_live_waiting`), handled before the inbox's next
        self.held: list = []
        core.cut_steps_when(self._live_waiting)
        self.profiler = None  # /start_profile's traces, with a folder for them
        if core.config.model.profiler_dir:
            from tidal.engine.trace_profiler import TraceProfiler  # torch: this process only

            self.profiler = TraceProfiler(core.config.model.profiler_dir, f"tidal-core{index}",
                                          core.executor.info.on_gpu)

    def send(self, msg) -> None:
        self.outbox.send(m.encoder.encode(msg))

    def run(self, parent: int) -> None:
        core, link = self.core, self.link
        status = StatusLine(core, core.config.model.log_stats_interval)
        while True:
            outputs: list[RequestOutput] = []
            if self.held:  # taken during the last step: before the wait is chosen
                self._take_messages()
            for sock in [self.inbox, *(link.sockets if link else ())]:
                if sock not in self.polled:  # a link's peer monitors come and go
                    self.poller.register(sock, zmq.POLLIN)
                    self.polled.add(sock)
            # Idle for a while with step-time shapes left to time: one per pass, messages
            # between (a client sending one request after another never waits for one).
            now = time.monotonic()
            if core.has_work() or self.compiling:
                self.busy_at = now
            timing = core.profiling() and now - self.busy_at >= PROFILE_AFTER_IDLE_S
            if core.can_step() or timing:
                wait = 0  # ms
            elif self.compiling:
                wait = 5
            elif core.profiling():  # until idle long enough (stats go out meanwhile)
                wait = min(200, max(1, int(1000 * (self.busy_at + PROFILE_AFTER_IDLE_S - now))))
            else:
                wait = 200
            for sock, _ in self.poller.poll(wait):
                if sock is self.inbox:
                    self._take_messages()
                else:
                    outputs += link.handle(sock)
            self._admit_compiled()
            idle = not core.has_work() and not self.compiling
            if self.deadline is not None and (idle or time.monotonic() > self.deadline):
                for rid in list(core.scheduler.requests):  # drain timed out: end the rest
                    core.abort(rid)
                self.compiling.clear()
                self.compiler.shutdown(wait=False, cancel_futures=True)
                log.info("engine core stopped")
                return
            started = time.perf_counter() if core.can_step() else None
            if started is not None:
                outputs += core.step()
                status.maybe_log()
                if self.profiler:
                    self.profiler.stepped()
            timing = timing and started is None and not self.compiling and self.deadline is None
            if link is not None:
                outputs = link.after_step(outputs)
            if outputs:
                self.send(m.Outputs(self.index, outputs, self.incarnation))
            if started is not None:
                self.step_seconds += time.perf_counter() - started
            now = time.monotonic()
            if now - self.last_stats >= 0.5 or timing:  # a timed shape holds the loop a while
                self.last_stats = now
                self.send(m.Stats(self.index, self.adds_seen, core.scheduler.stats(),
                                  core.prompt_tokens, core.generation_tokens,
                                  core.execute_seconds, self.step_seconds, self.incarnation,
                                  self._view(), core.step_time_error(),
                                  core.step_time.coefficients() if core.step_time else [],
                                  core.step_target_ms()))
                if os.getppid() != parent:  # the frontend died: do not linger as an orphan
                    log.warning("frontend process gone; engine core exiting")
                    return
            if timing:
                core.profile_idle()

    def _view(self) -> SchedulerView | None:
        """The scheduler's view with the steps since the last one, while dashboards watch."""
        if not self.viewers:
            return None
        view = scheduler_view(self.core.scheduler, self.core.history, self.last_view)
        self.last_view = view.steps[-1].time if view.steps else self.last_view
        return view

    def _receive(self) -> None:
        """Move the inbox's waiting messages to `held`, in the order they came."""
        while True:
            try:
                self.held.append(m.to_core.decode(self.inbox.recv(zmq.NOBLOCK)))
            except zmq.Again:
                return

    def _live_waiting(self) -> bool:
        """Asked between the layers of a step of background work: whether a live request
        has arrived. The inbox's messages are taken (and held for the loop) to see."""
        self._receive()
        return any(isinstance(msg, m.Add) and not msg.params.background for msg in self.held)

    def _take_messages(self) -> None:
        core, link = self.core, self.link
        self._receive()
        held, self.held = self.held, []
        for msg in held:
            if isinstance(msg, m.Add):
                self.adds_seen += 1
                self.last_stats = 0.0  # report the new load after this step
                self._add(msg)
            elif isinstance(msg, m.Abort):
                if self.compiling.pop(msg.request_id, None) is not None:
                    continue  # never reached the scheduler
                if link is not None:
                    link.on_abort(msg.request_id)
                core.abort(msg.request_id)
            elif isinstance(msg, m.Finish):
                core.finish(msg.seq_id)
            elif isinstance(msg, m.Shutdown):
                self.deadline = time.monotonic() + msg.drain_timeout
                core.resume()  # draining finishes the requests a pause held
            elif isinstance(msg, m.Watch):
                self.viewers = msg.viewers
            elif isinstance(msg, m.Adapters):
                core.set_adapters(msg.adapters)
            elif isinstance(msg, m.ResetPrefixCache):
                core.reset_prefix_cache()
            elif isinstance(msg, m.Pause):
                core.pause()
            elif isinstance(msg, m.Resume):
                core.resume()
            elif isinstance(msg, m.StartProfile) and self.profiler:
                self.profiler.start(msg.num_steps)
            elif isinstance(msg, m.StopProfile) and self.profiler:
                self.profiler.stop()

    def _add(self, msg: m.Add) -> None:
        if msg.params.structured is not None:  # admitted once compiled (_admit_compiled)
            self.compiling[msg.request_id] = (
                self.compiler.submit(self.core.executor.compile_constraint, msg.params), msg)
            return
        self._admit(msg)

    def _admit_compiled(self) -> None:
        """Admit the requests whose constraint has compiled (in arrival order); refuse
        those whose constraint did not."""
        for rid, (future, msg) in list(self.compiling.items()):
            if not future.done():
                continue
            del self.compiling[rid]
            error = future.exception()
            if error is None:
                self._admit(msg)
            else:
                self.send(m.Rejected(rid, str(error)))

    def _admit(self, msg: m.Add) -> None:
        refusal = self.core.scheduler.role.refusal(msg.prefill_address,
                                                   msg.params.embed is not None)
        try:
            if refusal is not None:
                raise ValueError(refusal)
            self.core.add(msg.request_id, msg.prompt_token_ids, msg.params, msg.arrival_time)
            if self.link is not None:
                self.link.on_add(msg.request_id, msg.prefill_address)
        except ValueError as exc:
            self.send(m.Rejected(msg.request_id, str(exc)))
