"""Prefill/decode disaggregation between engine-core processes: KV blocks over ZMQ.

A decode core admits a request (blocks allocated, no compute: `remote_prefill`), then sends
a `PrefillTask` with its block ids to the prefill core the router named. The prefill core runs
the prompt on its prefill-only path, reads the request's blocks and sends them, with the first
token (and its logprobs and the prompt logprobs, where asked for) and both sides' block ids,
in one `KVBlocks` message per request; it frees its blocks once the bytes are out of its
cache. The decode core writes them into its own blocks and decodes on. Each side watches
its connections: when the peer's process dies, the requests that peer held end with an
error here and their blocks are freed.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import msgspec
import zmq
from zmq.utils.monitor import recv_monitor_message

from tidal.core import PromptLogprob, RequestOutput, SamplingParams, TokenLogprob

if TYPE_CHECKING:
    from tidal.engine.core import EngineCore

log = logging.getLogger("tidal.kv")


class PrefillTask(msgspec.Struct, tag=True):
    """decode -> prefill: compute this prompt and send its KV into my blocks."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    reply_to: str  # the decode core's KV address
    dst_block_ids: list[int]  # the decode side's blocks for the prompt, after its own cache hit
    skip_blocks: int  # leading prompt blocks the decode side already caches


class KVBlocks(msgspec.Struct, tag=True):
    """prefill -> decode: the prompt's KV and its first token, with that token's logprobs
    and the prompt logprobs where the request asked for them."""

    request_id: str
    first_token: int
    src_block_ids: list[int]
    dst_block_ids: list[int]
    shape: list[int]  # [layers, 2 (K, V), blocks, block_size, kv heads, row width]
    dtype: str
    data: bytes
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[PromptLogprob | None] | None = None


class PrefillFailed(msgspec.Struct, tag=True):
    """prefill -> decode: the prompt could not be computed; why."""

    request_id: str
    message: str


class AbortPrefill(msgspec.Struct, tag=True):
    """decode -> prefill: the request is gone; drop its prefill and its blocks."""

    request_id: str


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(PrefillTask | KVBlocks | PrefillFailed | AbortPrefill)


class KVLink:
    """One engine core's end of P/D transfer (prefill or decode role). The core's loop polls
    `sockets`, calls `handle(sock)` when one is readable, and `after_step(outputs)` after
    each step; both return the outputs for this core's own frontend (a landed first token's
    output carries the logprobs that came with it)."""

    def __init__(self, core: EngineCore, ctx: zmq.Context, host: str,
                 timeout: float = 300.0) -> None:
        self.core, self.ctx, self.timeout = core, ctx, timeout
        self.receives = core.scheduler.role.receives_kv  # else it hands KV off
        self.inbox = ctx.socket(zmq.PULL)
        self.address = f"tcp://{host}:{self.inbox.bind_to_random_port(f'tcp://{host}')}"
        self._peers: dict[str, zmq.Socket] = {}
        self._monitors: dict[zmq.Socket, str] = {}
        self._lost: set[str] = set()  # peers disconnected and not back: send them nothing
        # decode role: request -> (its prefill core, when the task went; None: not sent yet)
        self.prefill_of: dict[str, tuple[str, float | None]] = {}
        # prefill role: request -> (its decode core, its blocks there, blocks it skips)
        self.tasks: dict[str, tuple[str, list[int], int]] = {}
        self.own: set[str] = set()  # prefill role: its frontend's (prompt-only) requests

    @property
    def sockets(self) -> list[zmq.Socket]:
        return [self.inbox, *self._monitors]

    def close(self) -> None:
        for sock in [self.inbox, *self._peers.values(), *self._monitors]:
            sock.close(linger=0)

    # ------------------------------------------------------------------ connections
    def _peer(self, address: str) -> zmq.Socket:
        """The connection to another core, watched for its loss from the moment it opens."""
        sock = self._peers.get(address)
        if sock is None:
            sock = self._peers[address] = self.ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.SNDHWM, 0)
            monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECTED)
            self._monitors[monitor] = address
            sock.connect(address)
        return sock

    def _send(self, address: str, msg) -> None:
        self._peer(address).send(_encoder.encode(msg), copy=False)

    def _peer_lost(self, address: str) -> list[RequestOutput]:
        """The process at `address` is gone: end every request it was serving for us."""
        outputs = []
        self._lost.add(address)
        if self.receives:
            lost = [rid for rid, (a, _) in self.prefill_of.items() if a == address]
            for rid in lost:
                outputs += self._fail(rid, f"the prefill instance at {address} died")
        else:
            for rid in [rid for rid, t in self.tasks.items() if t[0] == address]:
                del self.tasks[rid]
                self.core.abort(rid)  # frees its blocks; nobody is left to send them to
        log.warning("KV peer %s disconnected", address)
        return outputs

    # ------------------------------------------------------------------ the core's loop
    def on_add(self, request_id: str, prefill_address: str | None) -> None:
        """A request from this core's frontend. decode role: remember which prefill core
        computes its prompt; prefill role: its outputs go to the frontend (an embedding or
        a score, which ends at its prompt)."""
        if self.receives:
            self.prefill_of[request_id] = (prefill_address or "", None)
        else:
            self.own.add(request_id)

    def on_abort(self, request_id: str) -> None:
        self.own.discard(request_id)
        entry = self.prefill_of.pop(request_id, None)
        if entry is not None and entry[1] is not None:  # its prompt is being computed
            self._send(entry[0], AbortPrefill(request_id))

    def handle(self, sock: zmq.Socket) -> list[RequestOutput]:
        if sock is not self.inbox:
            event = recv_monitor_message(sock)
            if event["event"] == zmq.EVENT_DISCONNECTED:
                return self._peer_lost(self._monitors[sock])
            self._lost.discard(self._monitors[sock])  # (re)connected
            return []
        outputs: list[RequestOutput] = []
        while True:
            try:
                msg = _decoder.decode(self.inbox.recv(zmq.NOBLOCK, copy=False).buffer)
            except zmq.Again:
                return outputs
            if isinstance(msg, PrefillTask):
                self._take_task(msg)
            elif isinstance(msg, KVBlocks):
                outputs += self._land(msg)
            elif isinstance(msg, PrefillFailed):
                if msg.request_id in self.prefill_of:
                    outputs += self._fail(msg.request_id, msg.message)
            elif isinstance(msg, AbortPrefill):
                if self.tasks.pop(msg.request_id, None) is not None:
                    self.core.abort(msg.request_id)

    def after_step(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """A prefill core sends each request's first token, with its logprobs, to the
        decode core that asked; a decode core sends out new tasks and expires old ones."""
        if self.receives:
            return self._send_tasks() + outputs + self._expire()
        own = []
        for o in outputs:  # prefill role: a decode core's request, or its frontend's own
            task = self.tasks.pop(o.request_id, None)
            if task is not None:
                self._hand_over(o, *task)
            elif o.request_id in self.own:
                own.append(o)
                if o.finished:
                    self.own.discard(o.request_id)
        return own

    # ------------------------------------------------------------------ decode side
    def _send_tasks(self) -> list[RequestOutput]:
        outputs = []
        sched, bs = self.core.scheduler, self.core.scheduler.block_size
        for rid in self.core.new_transfers:
            r = sched.requests.get(rid)
            if r is None or rid not in self.prefill_of:
                continue
            address = self.prefill_of[rid][0]
            if not address:
                outputs += self._fail(rid, "a decode instance serves requests sent by "
                                      "`tidal router` (kv_transfer_params.prefill_address)")
                continue
            if address in self._lost:  # e.g. its core restarted elsewhere: do not wait for it
                outputs += self._fail(rid, f"the prefill instance at {address} is gone")
                continue
            skip = r.num_cached_tokens // bs
            blocks = sched.kv.block_ids(rid)[skip:]
            self._send(address, PrefillTask(rid, r.prompt_token_ids, r.sampling_params,
                                            r.arrival_time, self.address, list(blocks), skip))
            self.prefill_of[rid] = (address, time.monotonic())
        self.core.new_transfers.clear()
        return outputs

    def _land(self, msg: KVBlocks) -> list[RequestOutput]:
        rid = msg.request_id
        if rid not in self.prefill_of or rid not in self.core.scheduler.transferring:
            return []  # aborted meanwhile: its blocks are already free
        del self.prefill_of[rid]
        try:
            if msg.src_block_ids:
                self.core.executor.write_blocks(msg.dst_block_ids, msg.data, msg.shape, msg.dtype)
        except ValueError as exc:
            return self._fail(rid, str(exc))
        out = self.core.scheduler.kv_received(rid, msg.first_token)
        out.logprobs, out.prompt_logprobs = msg.logprobs, msg.prompt_logprobs
        return [out]

    def _expire(self) -> list[RequestOutput]:
        now, outputs = time.monotonic(), []
        for rid, (address, sent) in list(self.prefill_of.items()):
            if sent is not None and now - sent > self.timeout:
                outputs += self._fail(rid, f"no KV from the prefill instance at {address} in "
                                      f"{self.timeout:g} s")
        return outputs

    def _fail(self, rid: str, message: str) -> list[RequestOutput]:
        self.prefill_of.pop(rid, None)
        return self.core.fail(rid, message)

    # ------------------------------------------------------------------ prefill side
    def _take_task(self, task: PrefillTask) -> None:
        try:
            self.core.add(task.request_id, task.prompt_token_ids, task.params,
                          task.arrival_time)
        except ValueError as exc:
            self._send(task.reply_to, PrefillFailed(task.request_id, str(exc)))
            return
        self.tasks[task.request_id] = (task.reply_to, task.dst_block_ids, task.skip_blocks)
        self._peer(task.reply_to)  # connect now, so the decode side's death is noticed

    def _hand_over(self, o: RequestOutput, reply_to: str, dst: list[int], skip: int) -> None:
        if not o.new_token_ids:  # ended without a token: an error or an abort here
            self._send(reply_to, PrefillFailed(o.request_id, o.finish_message or
                                               f"prefill ended: {o.finish_reason}"))
            return
        src: list[int] = []
        data, shape, dtype = b"", [], ""
        if o.kv_transfer:  # otherwise its first token already ended it: no KV needed
            src = list(self.core.scheduler.kv.block_ids(o.request_id))[skip:][:len(dst)]
            data, shape, dtype = self.core.executor.read_blocks(src)
            self.core.scheduler.kv_sent(o.request_id)  # the bytes are out of our cache
        self._send(reply_to, KVBlocks(o.request_id, o.new_token_ids[0], src, dst[:len(src)],
                                      shape, dtype, data, o.logprobs, o.prompt_logprobs))
