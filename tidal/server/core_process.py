"""The engine-core process: receives requests over ZMQ, steps the engine core, sends token
outputs and stats back, and logs a status line each second while busy."""

from __future__ import annotations

import logging
import os
import time

import zmq

from tidal.engine.config import EngineConfig
from tidal.engine.core import EngineCore
from tidal.server import messages as m

log = logging.getLogger("tidal.core")


class StatusLine:
    """One log line a second while the core has work: queues, KV, prefix hits, the decode
    reservation ratio and the tokens/s of prefill and decode since the last line."""

    def __init__(self, core: EngineCore, interval: float = 1.0) -> None:
        self.core, self.interval = core, interval
        self.last = time.monotonic()
        self.last_prompt, self.last_gen = core.prompt_tokens, core.generation_tokens

    def maybe_log(self) -> None:
        now = time.monotonic()
        if now - self.last < self.interval:
            return
        c, s = self.core, self.core.scheduler.stats()
        dt = now - self.last
        prefill_rate = (c.prompt_tokens - self.last_prompt) / dt
        decode_rate = (c.generation_tokens - self.last_gen) / dt
        log.info("running-decode %d, running-prefill %d, waiting %d, preempted %d, KV %.1f%%, "
                 "prefix hit %.1f%%, new_token_ratio %.3f, prefill %.1f tok/s, decode %.1f tok/s",
                 s.running_decode, s.running_prefill, s.waiting, s.preempted, 100 * s.kv_usage,
                 100 * s.prefix_hit_rate, s.new_token_ratio, prefill_rate, decode_rate)
        self.last, self.last_prompt, self.last_gen = now, c.prompt_tokens, c.generation_tokens


def run_core(config: EngineConfig, folder: str, eos_token_id: int | None, in_addr: str,
             out_addr: str, index: int = 0) -> None:
    """The process's main: build the core, say Ready, then serve until Shutdown or until the
    frontend process is gone. `index` names this core among data-parallel ones."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    parent = os.getppid()
    ctx = zmq.Context()
    inbox, outbox = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    inbox.connect(in_addr)
    outbox.connect(out_addr)
    outbox.setsockopt(zmq.LINGER, 2000)
    try:
        core = EngineCore(config, folder, eos_token_id)
    except Exception as exc:  # tell the frontend why instead of dying silently
        log.exception("engine core failed to start")
        outbox.send(m.encoder.encode(m.Failed(f"{type(exc).__name__}: {exc}")))
        outbox.close()
        ctx.term()
        return
    outbox.send(m.encoder.encode(m.Ready(index, core.max_model_len, core.vocab_size,
                                         core.runner.num_blocks, config.cache.block_size)))
    try:
        _serve(core, inbox, outbox, parent, index)
    finally:
        core.close()
        inbox.close(linger=0)
        outbox.close()
        ctx.term()


def _serve(core: EngineCore, inbox: zmq.Socket, outbox: zmq.Socket, parent: int,
           index: int) -> None:
    status = StatusLine(core)
    deadline: float | None = None  # set by Shutdown: drain until then
    last_stats = 0.0
    adds_seen = 0
    while True:
        if inbox.poll(0 if core.has_work() else 200):
            while True:
                try:
                    msg = m.to_core.decode(inbox.recv(zmq.NOBLOCK))
                except zmq.Again:
                    break
                if isinstance(msg, m.Add):
                    adds_seen += 1
                    last_stats = 0.0  # report the new load after this step
                    try:
                        core.add(msg.request_id, msg.prompt_token_ids, msg.params,
                                 msg.arrival_time)
                    except ValueError as exc:
                        outbox.send(m.encoder.encode(m.Rejected(msg.request_id, str(exc))))
                elif isinstance(msg, m.Abort):
                    core.abort(msg.request_id)
                elif isinstance(msg, m.Finish):
                    core.finish(msg.seq_id)
                elif isinstance(msg, m.Shutdown):
                    deadline = time.monotonic() + msg.drain_timeout
        if deadline is not None and (not core.has_work() or time.monotonic() > deadline):
            for rid in list(core.scheduler.requests):  # drain timed out: end the rest
                core.abort(rid)
            log.info("engine core stopped")
            return
        if core.has_work():
            outputs, logprobs = core.step()
            if outputs:
                outbox.send(m.encoder.encode(m.Outputs(index, outputs, logprobs)))
            status.maybe_log()
        now = time.monotonic()
        if now - last_stats >= 0.5:
            last_stats = now
            outbox.send(m.encoder.encode(m.Stats(index, adds_seen, core.scheduler.stats(),
                                                 core.prompt_tokens, core.generation_tokens)))
            if os.getppid() != parent:  # the frontend died: do not linger as an orphan
                log.warning("frontend process gone; engine core exiting")
                return
