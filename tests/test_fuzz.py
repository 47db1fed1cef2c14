"""Schema fuzzing of the HTTP API: schemathesis generates bodies from the server's own OpenAPI
schema (/openapi.json) for /v1/completions, /v1/chat/completions, /v1/messages, /v1/batches,
/tokenize and /detokenize, both valid ones and ones that break the schema, and sends each to
a real `tidal serve`. No answer may be a 5xx or take longer than a timeout; every 4xx
carries an OpenAI error body (Anthropic's on /v1/messages); a stream holds no error event;
afterwards every batch has ended with each of its lines answered, no request is left
running or waiting and every KV block is free, and the engine core is the one the server
started with.

TIDAL_FUZZ_EXAMPLES sets the examples per endpoint (default 100, derandomized); set, each run
draws new ones (docs/testing.md)."""

from __future__ import annotations

import collections
import copy
import json
import os
import time

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode

from server_fixtures import Server, metric

PATHS = ["/v1/completions", "/v1/chat/completions", "/v1/messages", "/v1/batches", "/tokenize",
         "/detokenize"]
EXAMPLES = int(os.environ.get("TIDAL_FUZZ_EXAMPLES", "100"))
TIMEOUT = 60.0  # seconds one request may take: no generation here runs near it
MAX_OUT = 4  # --max-total-tokens: what any one prompt may generate (cheap on 2 cores)
MODEL, VOCAB = "smollm2-135m", 49152
sent: collections.Counter = collections.Counter()  # (path, status, error param) -> requests


@pytest.fixture(scope="module")
def server():
    s = Server("--max-model-len", "512", "--max-total-tokens", str(MAX_OUT),
               "--max-pending", "16")
    s.first_core = s.core_pid()
    s.batch_files = [upload(s, "batch", [{"messages": [{"role": "user", "content": "hi"}]},
                                         {"messages": []}]),  # the second line is refused
                     upload(s, "batch", [{"prompt": "hi"}], "/v1/completions"),
                     upload(s, "user_data", [{"prompt": "hi"}], "/v1/completions")]
    yield s
    s.stop()


def upload(server: Server, purpose: str, bodies: list[dict],
           url: str = "/v1/chat/completions") -> str:
    """A file of batch lines (`bodies`, each with the served model and 2 tokens); its id."""
    text = "\n".join(json.dumps({"custom_id": f"c{i}", "method": "POST", "url": url,
                                 "body": {"model": MODEL, "max_tokens": 2, **body}})
                      for i, body in enumerate(bodies))
    r = httpx.post(server.url + "/v1/files", data={"purpose": purpose},
                   files={"file": ("in.jsonl", text.encode())})
    assert r.status_code == 200, r.text
    return r.json()["id"]


@pytest.fixture(scope="module")
def schemas(server):
    """The server's schema as it is, and narrowed to what the server accepts."""
    raw = httpx.get(server.url + "/openapi.json").json()
    return (schemathesis.openapi.from_dict(raw),
            schemathesis.openapi.from_dict(narrowed(raw, server.batch_files)))


def narrowed(raw: dict, files: list[str]) -> dict:
    """The schema with the checks it cannot express (the vocabulary, the served model, no
    empty prompt, stream_options only with stream, ...) written in, so that its bodies mostly
    generate: sampling parameters, stop strings, logit_bias and streams get exercised."""
    raw = copy.deepcopy(raw)
    models = raw["components"]["schemas"]
    text = {"type": "string", "minLength": 1, "maxLength": 64}
    token = {"type": "integer", "minimum": 0, "maximum": VOCAB - 1}
    ids = {"type": "array", "items": token, "minItems": 1, "maxItems": 64}
    null = {"type": "null"}
    out = {"type": "integer", "minimum": 1, "maximum": MAX_OUT}
    generation = {
        "model": {"enum": [MODEL]}, "max_tokens": out, "n": {"type": "integer", "minimum": 1,
                                                            "maximum": 4},
        "min_tokens": {"type": "integer", "minimum": 0, "maximum": 1},
        "stop": {"type": "array", "items": text, "maxItems": 4},
        "stop_token_ids": {**ids, "minItems": 0, "maxItems": 4},
        "logit_bias": {"type": "object", "maxProperties": 4,
                       "propertyNames": {"pattern": "^[1-9][0-9]{0,3}$"},
                       "additionalProperties": {"type": "number", "minimum": -100,
                                                "maximum": 100}},
        "stream_options": null, "kv_transfer_params": null}
    models["CompletionRequest"]["properties"].update(
        generation, best_of=null, prompt={"anyOf": [text, ids, {
            "type": "array", "items": text, "minItems": 1, "maxItems": 3}]})
    models["ChatRequest"]["properties"].update(
        generation, max_completion_tokens=out, top_logprobs=null, messages={
            "type": "array", "items": {"$ref": "#/components/schemas/ChatMessage"},
            "minItems": 1, "maxItems": 4})
    models["ChatMessage"]["properties"]["content"] = text
    models["ChatMessage"]["required"] = ["role", "content"]
    models["TokenizeRequest"]["properties"].update(model={"enum": [MODEL]}, prompt=text,
                                                   messages=null)
    models["TokenizeRequest"]["required"] = ["prompt"]
    models["DetokenizeRequest"]["properties"].update(model={"enum": [MODEL]}, tokens=ids)
    models["MessagesRequest"]["properties"].update(
        model={"enum": [MODEL]}, max_tokens=out, stop_sequences=generation["stop"],
        messages={"type": "array", "minItems": 1, "maxItems": 4, "items": {
            "type": "object", "required": ["role", "content"], "additionalProperties": False,
            "properties": {"role": {"enum": ["user", "assistant"]}, "content": text}}})
    models["MessagesRequest"]["required"] = ["messages", "max_tokens"]
    models["BatchCreate"]["properties"]["input_file_id"] = {"enum": files}
    return raw


def runnable(body):
    """A valid body made likelier to generate rather than be refused: the served model's
    name, and a large output limit folded into [1, MAX_OUT] (absurd values stay)."""
    if not isinstance(body, dict):
        return body
    body = {**body, "model": MODEL} if isinstance(body.get("model"), str) else body
    for key in ("max_tokens", "max_completion_tokens"):
        v = body.get(key)
        if type(v) is int and MAX_OUT < v < 10**9:
            body = {**body, key: v % MAX_OUT + 1}
    return body


def strict_json(text: str):
    """JSON as the spec has it: NaN and Infinity, which Python's parser takes, are errors."""
    def refuse(constant):
        raise AssertionError(f"{constant} in {text[:300]}")
    return json.loads(text, parse_constant=refuse)


def check(path: str, r: httpx.Response) -> None:
    assert r.status_code < 500, r.text
    if path == "/v1/messages":
        return check_anthropic(path, r)
    if r.status_code >= 400:
        error = strict_json(r.text)["error"]
        sent[path, r.status_code, error.get("param")] += 1
        assert set(error) == {"message", "type", "param", "code"}, error
        assert error["code"] is None or isinstance(error["code"], str), error  # OpenAI's
        assert error["message"], error
        return
    assert r.status_code == 200, r.text
    sent[path, 200, None] += 1
    if not r.headers["content-type"].startswith("text/event-stream"):
        strict_json(r.text)
        return
    events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert events and events[-1] == "[DONE]", r.text
    for event in events[:-1]:
        assert "error" not in strict_json(event), event


def check_anthropic(path: str, r: httpx.Response) -> None:
    """Anthropic's error shape, and its stream: no error event, `message_stop` last."""
    body = None if r.headers["content-type"].startswith("text/event-stream") else \
        strict_json(r.text)
    if r.status_code >= 400:
        assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, body
        assert body["error"]["message"], body
        sent[path, r.status_code, body["error"]["type"]] += 1
        return
    assert r.status_code == 200, r.text
    sent[path, 200, None] += 1
    if body is None:
        events = [strict_json(line[6:]) for line in r.text.splitlines()
                  if line.startswith("data: ")]
        assert events and events[-1]["type"] == "message_stop", r.text
        assert all(e["type"] != "error" for e in events), r.text
    else:
        assert body["type"] == "message", body


@pytest.mark.parametrize("path", PATHS)
def test_generated_bodies_get_answers_not_server_errors(server, schemas, path):
    loose, narrow = (schema[path]["POST"] for schema in schemas)
    bodies = st.one_of(
        narrow.as_strategy(GenerationMode.POSITIVE).map(lambda case: case.body),
        loose.as_strategy(GenerationMode.POSITIVE).map(lambda case: runnable(case.body)),
        loose.as_strategy(GenerationMode.NEGATIVE).map(lambda case: case.body))
    http = httpx.Client(timeout=TIMEOUT, headers={"content-type": "application/json"})

    @settings(max_examples=EXAMPLES, deadline=None, database=None,
              derandomize="TIDAL_FUZZ_EXAMPLES" not in os.environ,
              suppress_health_check=list(HealthCheck))
    @given(body=bodies)
    def one(body):
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        t0 = time.monotonic()
        check(path, http.post(server.url + path, content=content))
        assert time.monotonic() - t0 < TIMEOUT, body

    with http:
        one()


# What the fuzzer found once, kept as plain cases: (path, body, status, error param).
FOUND = [
    # a denormal repetition_penalty made logits inf: NaN logprobs, a 500 (invalid JSON streamed)
    ("/v1/completions", {"prompt": "]\x80\xd1", "logprobs": 0, "max_tokens": 2,
                         "repetition_penalty": 5e-324}, 200, None),
    ("/v1/completions", {"prompt": "hi", "logprobs": 2, "max_tokens": 2, "stream": True,
                         "repetition_penalty": 5e-324}, 200, None),
    # a non-string prefill address reached the engine core and killed it
    ("/v1/completions", {"prompt": "hi", "kv_transfer_params": {"prefill_address": 5}}, 400,
     "kv_transfer_params.prefill_address"),
    # a JSON syntax error named its character position as the field
    ("/tokenize", b"\x00", 400, None),
    # a union field named the member type that failed: "stop.str"
    ("/v1/completions", {"prompt": "hi", "stop": 5}, 400, "stop"),
    ("/v1/completions", {"prompt": [[1, "a"]]}, 400, "prompt.0.1"),
    # not generated (schemathesis draws valid Unicode): a lone surrogate, which JSON can
    # escape, made the tokenizer raise: a 500
    ("/v1/completions", {"prompt": "a\ud800", "max_tokens": 1}, 400, "prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "\udfff"}]}, 400,
     "messages"),
    ("/tokenize", {"prompt": "\ud800b"}, 400, "prompt"),
    ("/v1/completions", {"prompt": "hi", "stop": ["\ud800"]}, 400, "stop"),
    ("/v1/completions", {"prompt": "hi", "kv_transfer_params": {"prefill_address": "\ud800"}},
     400, "kv_transfer_params.prefill_address"),
]


@pytest.mark.parametrize("path,body,status,param", FOUND)
def test_what_fuzzing_found(server, path, body, status, param):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(server.url + path, content=content, timeout=TIMEOUT,
                   headers={"content-type": "application/json"})
    check(path, r)
    assert r.status_code == status, r.text
    if status != 200:
        assert r.json()["error"]["param"] == param, r.text


def test_nothing_is_left_behind(server):
    """Every generated request finished or was refused: every batch ended with each line
    answered once, nothing running, waiting or holding blocks, and the engine core never
    died."""
    deadline = time.monotonic() + 120  # the batches' lines run one after another
    while any(b["status"] in ("validating", "in_progress", "finalizing")
              for b in all_batches(server)):
        assert time.monotonic() < deadline, all_batches(server)
        time.sleep(0.5)
    batches = all_batches(server)
    for b in batches:
        counts = b["request_counts"]
        assert b["status"] == "completed", b
        assert counts["completed"] + counts["failed"] == counts["total"] > 0, b
    deadline = time.monotonic() + 15  # the core reports stats twice a second
    names = ("tidal:kv_cache_used_blocks", "tidal:num_requests_running",
             "tidal:num_requests_waiting")
    while any(metric(server.url, name) > 0 for name in names):
        assert time.monotonic() < deadline, {n: metric(server.url, n) for n in names}
        time.sleep(0.2)
    assert server.core_pid() == server.first_core
    print(f"\n{len(batches)} batches; fuzzed requests by (path, status, error param):")
    for key, count in sorted(sent.items(), key=str):
        print(f"  {count:5d} {key}")


def all_batches(server: Server) -> list[dict]:
    """Every batch on the server, through the listing's pages."""
    found, after = [], None
    while True:
        page = httpx.get(server.url + "/v1/batches",
                         params={"limit": 100, **({"after": after} if after else {})}).json()
        found += page["data"]
        if not page["has_more"]:
            return found
        after = page["last_id"]
