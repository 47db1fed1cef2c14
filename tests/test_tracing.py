"""OpenTelemetry traces (`--otlp-traces-endpoint`): the engine core's scheduler events of a
traced request, and end to end a server exporting one `llm_request` span per request to an
OTLP/HTTP collector (a small one here, decoding the protobuf): the client's traceparent
continued, the GenAI attributes, the scheduler's events in time order; nothing traced or
recorded without the flag."""

from __future__ import annotations

import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer

import httpx
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from server_fixtures import Server
from tidal import SamplingParams
from tidal.core import RequestOutput, ScheduledRequest, SchedulerOutput
from tidal.engine.request_events import RequestEvents

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT = "00f067aa0ba902b7"


def test_a_traced_requests_events_come_with_its_outputs():
    events = RequestEvents()
    events.add("a", 100.0)
    out = SchedulerOutput(step=1, kind="prefill", scheduled=[
        ScheduledRequest("a", 16, 0, [0], False, True), ScheduledRequest("b", 4, 0, [1], True,
                                                                          True)])
    events.planned(out, 101.0)
    events.planned(SchedulerOutput(step=2, kind="prefill", scheduled=[
        ScheduledRequest("a", 4, 16, [0, 2], True, True)]), 102.0)
    first = RequestOutput("a", [7])
    events.attach([first, RequestOutput("b", [8])])
    assert [(name, at) for name, at, _ in first.events] == [
        ("queued", 100.0), ("admitted", 101.0), ("prefill_chunk", 101.0),
        ("prefill_chunk", 102.0)]
    assert first.events[3][2] == {"tokens": 4, "computed_tokens": 16}
    events.planned(SchedulerOutput(step=3, kind="idle", preempted_ids=["a"]), 103.0)
    again = RequestOutput("a", [9], finished=True)
    events.attach([again])
    assert [e[0] for e in again.events] == ["preempted"] and not events


class Collector(BaseHTTPRequestHandler):
    spans: list = []

    def do_POST(self):  # noqa: N802 (http.server's name)
        body = self.rfile.read(int(self.headers["content-length"]))
        request = ExportTraceServiceRequest()
        request.ParseFromString(body)
        for resource in request.resource_spans:
            for scope in resource.scope_spans:
                Collector.spans.extend(scope.spans)
        self.send_response(200)
        self.send_header("content-type", "application/x-protobuf")
        self.end_headers()
        self.wfile.write(b"")

    def log_message(self, *args):
        pass


@pytest.fixture()
def collector():
    http = HTTPServer(("127.0.0.1", 0), Collector)
    threading.Thread(target=http.serve_forever, daemon=True).start()
    Collector.spans = []
    yield f"http://127.0.0.1:{http.server_address[1]}/v1/traces"
    http.shutdown()


def value(attribute):
    v = attribute.value
    return getattr(v, v.WhichOneof("value"))


def test_a_served_request_is_one_span_continuing_the_clients_trace(collector):
    server = Server("--otlp-traces-endpoint", collector)
    try:
        r = httpx.post(server.url + "/v1/chat/completions", timeout=120, headers={
            "traceparent": f"00-{TRACE}-{PARENT}-01"}, json={
            "model": "smollm2-135m", "max_tokens": 6, "temperature": 0,
            "messages": [{"role": "user", "content": "What is the capital of France?"}]})
        usage = r.json()["usage"]
        httpx.post(server.url + "/v1/completions", timeout=120,
                   json={"prompt": "Hello", "max_tokens": 2})  # a root span of its own
        deadline = time.monotonic() + 30
        while len(Collector.spans) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
    finally:
        server.stop()
    chat, plain = sorted(Collector.spans, key=lambda s: s.start_time_unix_nano)
    assert chat.name == "llm_request" and chat.trace_id.hex() == TRACE
    assert chat.parent_span_id.hex() == PARENT
    assert plain.trace_id.hex() != TRACE and not plain.parent_span_id
    attrs = {a.key: value(a) for a in chat.attributes}
    assert attrs["gen_ai.operation.name"] == "chat"
    assert attrs["gen_ai.request.model"] == "smollm2-135m"
    assert attrs["gen_ai.usage.input_tokens"] == usage["prompt_tokens"]
    assert attrs["gen_ai.usage.output_tokens"] == usage["completion_tokens"]
    assert attrs["gen_ai.request.max_tokens"] == 6
    assert 0 < attrs["gen_ai.latency.time_to_first_token"] <= attrs["gen_ai.latency.e2e"]
    assert attrs["gen_ai.latency.time_in_queue"] >= 0
    names = [e.name for e in chat.events]
    assert names[:3] == ["queued", "admitted", "prefill_chunk"]
    assert names[-2:] == ["first_token", "finished"]
    times = [e.time_unix_nano for e in chat.events]
    assert times == sorted(times)
    assert chat.start_time_unix_nano <= times[0] and times[-1] <= chat.end_time_unix_nano
    assert {a.key: value(a) for a in plain.attributes}["gen_ai.operation.name"] == \
        "text_completion"


def test_without_the_flag_nothing_is_recorded():
    from tidal import LLM

    llm = LLM("smollm2-135m", num_kv_blocks=64, num_threads=1)
    try:
        core = llm.engine.core
        llm.generate(["Hi"], SamplingParams(max_tokens=2), use_tqdm=False)
        assert not core.events  # untraced: no events kept
        llm.generate(["Hi"], SamplingParams(max_tokens=2, trace=True), use_tqdm=False)
        assert not core.events  # handed over and forgotten once finished
    finally:
        llm.close()
