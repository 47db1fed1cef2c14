"""The discrete-event simulator: a workload replayed through real schedulers on a virtual
clock, for one replica, N data-parallel replicas behind a router, or xPyD disaggregation
(prefill replicas hand each prompt's KV to decode replicas over a link of given bandwidth).

Events are sends, arrivals, step ends and KV transfer ends; a replica that is free and has
work starts its next step at once, so virtual time jumps from event to event. A request
arrives at its scheduler `request_latency` after it is sent (the serving frontend's share);
with a concurrency cap, a send waits for a request to finish, as the bench client's does."""

from __future__ import annotations

import dataclasses
import heapq
from collections import deque
from dataclasses import dataclass, field

from tidal.bench.dataset import BenchRequest
from tidal.bench.metrics import RequestResult
from tidal.cluster.routing import CoreLoad, Router
from tidal.core import CacheConfig, Request, SamplingParams, SchedulerConfig
from tidal.sim.cost_model import CostModel
from tidal.sim.dashboard import DashboardRecorder
from tidal.sim.replica import SimReplica, TokenClock

_SEND, _ARRIVAL, _STEP_END, _TRANSFER_END, _WAKE = 0, 1, 2, 3, 4


@dataclass
class ClusterSpec:
    """The simulated topology."""

    data_parallel_size: int = 1  # mixed replicas behind the router (when not xPyD)
    num_prefill: int = 0  # xPyD: prefill replicas (both counts > 0 selects disaggregation)
    num_decode: int = 0  # xPyD: decode replicas
    routing: str = "round_robin"  # how the router picks a replica (tidal.cluster.routing)
    link_bandwidth: float = 50e9  # bytes/s of one KV transfer (400 Gb/s RDMA)
    link_latency: float = 20e-6  # seconds added to every transfer
    # xPyD: "prefill-only" runs the prefill role's path (no admission queue, every running
    # prompt chunked under the full budget, blocks held until the KV is sent); "shared" runs
    # the mixed scheduler with max_tokens=1 (its admission, reservation and one chunked
    # prompt a step), freeing blocks when the token is out: optimistic for "shared".
    prefill_path: str = "prefill-only"
    sample_interval: float = 1.0  # virtual seconds between timeline samples
    spec_acceptance: float = 0.0  # speculative decoding: the chance a guess is accepted

    @property
    def disaggregated(self) -> bool:
        return self.num_prefill > 0 or self.num_decode > 0


@dataclass
class SimRun:
    """What a simulation produced: per-request results and the timeline."""

    results: list[RequestResult]
    duration: float
    timeline: dict[str, list[float]] = field(default_factory=dict)
    steps: int = 0
    preemptions: int = 0
    busy_seconds: float = 0.0  # summed step times of every replica (an engine's busy time)


class Simulator:
    """Replays requests through SimReplicas; `run()` returns a SimRun."""

    def __init__(self, spec: ClusterSpec, sched: SchedulerConfig, cache: CacheConfig,
                 cost: CostModel) -> None:
        self.spec, self.cost = spec, cost
        if spec.disaggregated:
            if spec.num_prefill < 1 or spec.num_decode < 1:
                raise ValueError("xPyD needs at least one prefill and one decode replica")
            if spec.prefill_path not in ("prefill-only", "shared"):
                raise ValueError(f"prefill_path must be 'prefill-only' or 'shared'; got "
                                 f"{spec.prefill_path!r}")
            role = "prefill" if spec.prefill_path == "prefill-only" else "mixed"
            self.prefill = [SimReplica(sched, cache, cost, role)
                            for _ in range(spec.num_prefill)]
            self.decode = [SimReplica(sched, cache, cost, "decode", spec.spec_acceptance, i)
                           for i in range(spec.num_decode)]
            self.replicas = self.prefill + self.decode
        else:
            if spec.data_parallel_size < 1:
                raise ValueError("data_parallel_size must be at least 1")
            self.replicas = [SimReplica(sched, cache, cost, "mixed", spec.spec_acceptance, i)
                             for i in range(spec.data_parallel_size)]
            self.prefill, self.decode = [], self.replicas
        self.prefill_router = Router(spec.routing, max(1, len(self.prefill)))
        self.router = Router(spec.routing, len(self.decode))
        self._shared_prefill = spec.disaggregated and spec.prefill_path == "shared"
        self._events: list[tuple] = []
        self._seq = 0
        self._home: dict[str, tuple[SimReplica, SimReplica | None]] = {}
        # The concurrency gate of run(): requests sent and not finished, sends waiting, and
        # finishes not yet counted out of the gate.
        self._in_flight, self._held, self._released = 0, deque(), 0
        self.recorder: DashboardRecorder | None = None  # dashboard frames, when asked for
        self._sent: list[float] = []

    def record_dashboard(self, recorder: DashboardRecorder) -> None:
        """Collect dashboard frames during `run()` (costs a view per replica a frame)."""
        self.recorder = recorder
        recorder.attach(self.replicas)

    def _push(self, time: float, kind: int, payload) -> None:
        self._seq += 1
        heapq.heappush(self._events, (time, kind, self._seq, payload))

    def _route(self, router: Router, replicas: list[SimReplica], request: Request) -> SimReplica:
        if len(replicas) == 1:
            return replicas[0]
        loads = [CoreLoad(r.outstanding, r.scheduler.kv.num_free,
                          len(r.scheduler.kv.match_prefix(request)) * r.scheduler.block_size
                          if router.needs_prefix else 0,
                          r.scheduler.prefill_backlog(r.scheduler.waiting)
                          if router.needs_backlog else 0) for r in replicas]
        return replicas[router.choose(loads)]

    def run(self, requests: list[BenchRequest], send_times: list[float],
            max_concurrency: int | None = None) -> SimRun:
        clocks = {str(i): TokenClock() for i in range(len(requests))}  # by request id
        done: list[str | None] = [None] * len(requests)  # each request's finish reason
        sent = list(send_times)  # when each request really went out (later when gated)
        self._sent = sent
        timeline: dict[str, list[float]] = {"time": [], "kv_usage": [], "running": [],
                                           "waiting": [], "preemptions": []}
        latency = self.cost.hw.request_latency
        # Sends enter the heap one at a time in time order (ties in index order), so the heap
        # holds a few events per replica rather than the whole workload.
        sends = iter(sorted(range(len(send_times)), key=send_times.__getitem__))
        first = next(sends, None)
        if first is not None:
            self._push(send_times[first], _SEND, first)
        next_sample, now = 0.0, 0.0
        dirty: set[SimReplica] = set()
        while self._events:
            now, kind, _, payload = heapq.heappop(self._events)
            if kind == _SEND:
                following = next(sends, None)
                if following is not None:
                    self._push(send_times[following], _SEND, following)
                if max_concurrency and self._in_flight >= max_concurrency:
                    self._held.append(payload)
                else:
                    self._send(payload, now + latency)
            elif kind == _ARRIVAL:
                dirty.add(self._arrive(payload, requests[payload], now))
            elif kind == _STEP_END:
                replica = payload
                dirty.add(replica)
                self._step_end(replica, now, clocks, done, dirty)
                if now >= next_sample:
                    self._sample(timeline, now)
                    next_sample = now + self.spec.sample_interval
                if self.recorder is not None:
                    self.recorder.maybe_record(now, self.replicas)
            elif kind == _WAKE:  # a pipeline's first stage is free for the next step
                dirty.add(payload)
            else:
                self._transfer_end(payload, now, clocks, done, dirty)
            while dirty:
                replica = dirty.pop()
                room = len(replica.flight) < replica.depth
                if room and replica.stage_free[0] > now:
                    self._push(replica.stage_free[0], _WAKE, replica)  # its first stage's turn
                elif room:
                    end = replica.start(now)
                    if end is not None:
                        self._push(end, _STEP_END, replica)
                        if len(replica.flight) < replica.depth:  # the next step's turn
                            self._push(replica.stage_free[0], _WAKE, replica)
                    if replica.early:  # rejected before any compute: answered now
                        early, replica.early = replica.early, []
                        self._outputs(replica, early, now, clocks, done, dirty)
                    if replica.pending_transfers:
                        self._start_transfers(replica, dirty)
            while self._released:  # finished requests let held sends go
                self._released -= 1
                self._in_flight -= 1
                if self._held:
                    index = self._held.popleft()
                    sent[index] = now
                    self._send(index, now + latency)
        results = [self._result(req, t, clock, reason) for req, t, clock, reason
                   in zip(requests, sent, clocks.values(), done)]
        return SimRun(results, now, timeline, sum(r.steps for r in self.replicas),
                      sum(r.scheduler.num_preemptions for r in self.replicas),
                      sum(r.busy_seconds for r in self.replicas))

    def _send(self, index: int, arrival: float) -> None:
        """A request goes out through the concurrency gate; it reaches its scheduler at
        `arrival`."""
        self._in_flight += 1
        self._push(arrival, _ARRIVAL, index)

    # ------------------------------------------------------------------ events
    def _arrive(self, index: int, req: BenchRequest, now: float) -> SimReplica:
        params = SamplingParams(max_tokens=req.output_len, temperature=0.0, ignore_eos=True,
                                lora=req.model)  # a LoRA adapter (--lora-modules)
        request = Request(str(index), req.prompt_ids, params, arrival_time=now)
        target = self._route(self.router, self.decode, request)
        target.add(request)
        self._home[request.request_id] = (target, None)
        return target

    def _start_transfers(self, replica: SimReplica, dirty: set[SimReplica]) -> None:
        """Decode role: requests that got their blocks go to a prefill replica now."""
        while replica.pending_transfers:
            rid = replica.pending_transfers.pop()
            decode_req = replica.scheduler.requests[rid]
            params = decode_req.sampling_params
            if self._shared_prefill:  # the mixed scheduler prefills by generating one token
                params = dataclasses.replace(params, max_tokens=1)
            request = Request(rid, decode_req.prompt_token_ids, params,
                              arrival_time=decode_req.arrival_time)
            target = self._route(self.prefill_router, self.prefill, request)
            target.add(request)
            self._home[rid] = (replica, target)
            dirty.add(target)

    def _step_end(self, replica: SimReplica, now: float, clocks: dict[str, TokenClock],
                  done: list[str | None], dirty: set[SimReplica]) -> None:
        self._outputs(replica, replica.finish(), now, clocks, done, dirty)

    def _outputs(self, replica: SimReplica, outputs: list, now: float,
                 clocks: dict[str, TokenClock], done: list[str | None],
                 dirty: set[SimReplica]) -> None:
        shared = self._shared_prefill
        for o in outputs:
            if o.kv_transfer or (shared and o.finish_reason == "length"
                                 and self._home[o.request_id][1] is replica):
                # the prompt's KV (and first token) now travels to its decoder
                decoder = self._home[o.request_id][0]
                prompt = len(decoder.scheduler.requests[o.request_id].prompt_token_ids)
                self._push(now + self.cost.transfer_time(prompt, self.spec.link_bandwidth,
                                                         self.spec.link_latency),
                           _TRANSFER_END, (o.request_id, o.new_token_ids[0]))
                continue
            if o.new_token_ids:
                clock = clocks[o.request_id]  # TokenClock.tick, inlined: once per token
                if clock.count:
                    clock.itl.append(now - clock.last)
                else:
                    clock.first = now
                clock.last = now
                clock.count += len(o.new_token_ids)  # a verification emits several
            if o.finished:
                self._released += 1
                done[int(o.request_id)] = o.finish_reason
                if self.recorder is not None and clocks[o.request_id].count:
                    clock = clocks[o.request_id]
                    self.recorder.finished(now, clock.first - self._sent[int(o.request_id)],
                                           sum(clock.itl) / len(clock.itl) if clock.itl else None)
                decoder, prefiller = self._home.pop(o.request_id)
                if prefiller is replica:  # ended at its prefill: free the decode side too
                    decoder.scheduler.abort(o.request_id)
                    dirty.add(decoder)

    def _transfer_end(self, payload: tuple[str, int], now: float, clocks: dict[str, TokenClock],
                      done: list[str | None], dirty: set[SimReplica]) -> None:
        rid, token = payload
        decoder, prefiller = self._home[rid]
        if not self._shared_prefill:  # the shared path freed the blocks at its finish
            prefiller.scheduler.kv_sent(rid)
        out = decoder.scheduler.kv_received(rid, token)
        clocks[rid].tick(now)
        if out.finished:
            self._released += 1
            done[int(rid)] = out.finish_reason
            del self._home[rid]
        dirty.update((decoder, prefiller))

    def _sample(self, timeline: dict[str, list[float]], now: float) -> None:
        used = total = running = waiting = preemptions = 0
        for r in self.replicas:
            s = r.scheduler
            total += s.kv.num_blocks
            used += s.kv.num_blocks - s.kv.num_free
            running += len(s.running)
            waiting += len(s.waiting)
            preemptions += s.num_preemptions
        for key, value in (("time", now), ("kv_usage", used / total), ("running", running),
                           ("waiting", waiting), ("preemptions", preemptions)):
            timeline[key].append(value)

    @staticmethod
    def _result(req: BenchRequest, sent: float, clock: TokenClock,
                reason: str | None) -> RequestResult:
        r = RequestResult(prompt_len=req.prompt_len, output_len=clock.count, start=sent,
                          success=reason in ("stop", "length") and clock.count > 0)
        if clock.count:
            r.ttft, r.itl, r.latency = clock.first - sent, clock.itl, clock.last - sent
        if not r.success:
            r.error = "rejected" if reason == "rejected" else "did not finish"
        return r
