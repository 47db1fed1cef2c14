"""The scheduler's events of traced requests (SamplingParams.trace), with wall times, for the
frontend's trace spans: `queued` (arrival), `admitted` (its first step), `prefill_chunk`
(each step that computes prompt tokens: how many, and how many were computed before) and
`preempted`. They are read off each step's plan, so the scheduler stays pure, and handed
over with the request's next output (`RequestOutput.events`); the frontend adds the first
token and the end, which it sees itself."""

from __future__ import annotations

from tidal.core import RequestOutput, SchedulerOutput

Event = tuple[str, float, dict[str, int]]  # name, unix seconds, attributes


class RequestEvents:
    """Events of the traced requests not yet handed over, by request id."""

    def __init__(self) -> None:
        self._pending: dict[str, list[Event]] = {}
        self._admitted: set[str] = set()

    def __bool__(self) -> bool:
        return bool(self._pending)

    def add(self, rid: str, arrival: float) -> None:
        self._pending[rid] = [("queued", arrival, {})]

    def planned(self, out: SchedulerOutput, now: float) -> None:
        """A step's plan, made at `now`: admissions, prompt chunks and preemptions."""
        pending = self._pending
        for x in out.scheduled:
            events = pending.get(x.request_id)
            if events is None or not x.is_prefill:
                continue
            if x.request_id not in self._admitted:
                self._admitted.add(x.request_id)
                events.append(("admitted", now, {"cached_tokens": x.num_computed_tokens}))
            events.append(("prefill_chunk", now, {"tokens": x.num_new_tokens,
                                                  "computed_tokens": x.num_computed_tokens}))
        for rid in out.preempted_ids:
            if rid in pending:
                self._admitted.discard(rid)  # its next chunk admits it again
                pending[rid].append(("preempted", now, {}))

    def attach(self, outputs: list[RequestOutput]) -> None:
        """Hand each traced request's events over with its output; a finished one is
        forgotten."""
        for o in outputs:
            events = self._pending.get(o.request_id)
            if events is None:
                continue
            if events:
                o.events, self._pending[o.request_id] = events, []
            if o.finished:
                self.forget(o.request_id)

    def forget(self, rid: str) -> None:
        self._pending.pop(rid, None)
        self._admitted.discard(rid)
