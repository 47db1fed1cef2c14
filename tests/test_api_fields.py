"""Every request field is honoured or refused: OpenAI's chat and completion fields against
the server's models, each refusal as a 400 naming its field, harmless fields that change
nothing, content parts, logit_bias, /tokenize and /detokenize, and Retry-After on 429s. End
to end against a real `tidal serve` (the official `openai` client where it can send the
field, httpx for raw bodies)."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from openai.types import completion_create_params as completion_types
from openai.types.chat import (ChatCompletionAssistantMessageParam,
                               ChatCompletionContentPartTextParam,
                               ChatCompletionDeveloperMessageParam,
                               ChatCompletionStreamOptionsParam,
                               ChatCompletionSystemMessageParam, ChatCompletionToolMessageParam,
                               ChatCompletionUserMessageParam)
from openai.types.chat import completion_create_params as chat_types

from server_fixtures import Server
from tidal.core import SamplingParams
from tidal.engine import messages as m
from tidal.server.openai.chat import ChatMessage, ChatRequest, chat_prompt_text
from tidal.server.openai.protocol import APIError, CompletionRequest, StreamOptions

KEY = "fields-key"
MODEL = "smollm2-135m"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
CHAT = {"model": MODEL, "messages": QUESTION, "max_tokens": 8, "temperature": 0}
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
COMPLETION = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 8,
              "temperature": 0, "ignore_eos": True}


def keys(typed_dict) -> set[str]:
    return set(typed_dict.__required_keys__ | typed_dict.__optional_keys__)


# ---------------------------------------------------------------------- the field lists

def test_every_openai_request_field_is_declared_or_refused():
    """A field the openai package knows that tidal neither declares nor lists as refused
    would be an 'Unrecognized' 400: this catches OpenAI adding fields."""
    for model, params in ((ChatRequest, chat_types.CompletionCreateParamsStreaming),
                          (CompletionRequest, completion_types.CompletionCreateParamsStreaming)):
        missing = keys(params) - set(model.model_fields) - set(model._refused)
        assert missing == set(), (model.__name__, missing)
    assert keys(ChatCompletionStreamOptionsParam) <= set(StreamOptions.model_fields)
    for message in (ChatCompletionSystemMessageParam, ChatCompletionDeveloperMessageParam,
                    ChatCompletionUserMessageParam, ChatCompletionAssistantMessageParam,
                    ChatCompletionToolMessageParam):
        missing = keys(message) - set(ChatMessage.model_fields) - set(ChatMessage._refused)
        assert missing == set(), (message.__name__, missing)
    assert keys(ChatCompletionContentPartTextParam) == {"type", "text", "prompt_cache_breakpoint"}


def test_logit_bias_survives_the_trip_to_the_engine_core():
    add = m.Add("r", [1, 2], SamplingParams(logit_bias={7: -100, 9: 2.5}), 0.0)
    back = m.to_core.decode(m.encoder.encode(add))
    assert back.params.logit_bias == {7: -100.0, 9: 2.5}


class _RecordingTokenizer:
    """Records what it is asked; its chat template refuses conversations ending with 'x'."""

    def __init__(self) -> None:
        self.calls = []

    def encode(self, text, add_special_tokens=True):
        self.calls.append((text, add_special_tokens))
        return [1, 2, 3]

    def apply_chat_template(self, messages, add_generation_prompt=True, **kwargs):
        if messages[-1]["content"] == "x":
            raise ValueError("Conversation roles must alternate")
        return f"{messages}{add_generation_prompt}"


def test_add_special_tokens_reaches_the_tokenizer_and_template_errors_are_400s():
    tk = _RecordingTokenizer()
    CompletionRequest(prompt=["a", "b"]).prompt_ids(tk)
    CompletionRequest(prompt="c", add_special_tokens=False).prompt_ids(tk)
    assert tk.calls == [("a", True), ("b", True), ("c", False)]  # vLLM's defaults and choice
    tk.calls.clear()
    ChatRequest(messages=QUESTION).prompt_ids(tk)
    ChatRequest(messages=QUESTION, add_special_tokens=True,
                add_generation_prompt=False).prompt_ids(tk)
    assert [c[1] for c in tk.calls] == [False, True]
    assert tk.calls[0][0].endswith("True") and tk.calls[1][0].endswith("False")
    with pytest.raises(APIError) as err:
        chat_prompt_text([ChatMessage(role="user", content="x")], tk, True)
    assert err.value.status == 400 and err.value.param == "messages"
    assert "must alternate" in err.value.message


# ---------------------------------------------------------------------- the server

@pytest.fixture(scope="module")
def server():
    s = Server("--api-key", KEY)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)


def post(server, path, body, key=KEY):
    headers = {"authorization": f"Bearer {key}"} if key else {}
    return httpx.post(server.url + path, json=body, headers=headers, timeout=60)


def refused(r: httpx.Response, param: str) -> str:
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error
    return error["message"]


SENTINEL = "a value no refused field accepts"


@pytest.mark.parametrize("path,base,model", [
    ("/v1/chat/completions", CHAT, ChatRequest),
    ("/v1/completions", COMPLETION, CompletionRequest)])
def test_each_refused_field_is_a_400_naming_it(server, path, base, model):
    for field in model._refused:
        message = refused(post(server, path, {**base, field: SENTINEL}), field)
        assert message.startswith(f"{field} ") and "not supported" in message, message


@pytest.mark.parametrize("path,body,param,words", [
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "xml"}},
     "response_format.type", "not supported"),
    ("/v1/chat/completions", {**CHAT, "tool_choice": "required"}, "tool_choice", "needs tools"),
    ("/v1/chat/completions", {**CHAT, "functions": [{"name": "f"}]}, "functions", "use tools"),
    ("/v1/chat/completions", {**CHAT, "tools": [TOOL], "tool_choice": "sometimes"},
     "tool_choice", "'none', 'auto' or 'required'"),
    ("/v1/chat/completions", {**CHAT, "tools": [{**TOOL, "function": {"name": "f g"}}]},
     "tools.0.function.name", "pattern"),
    ("/v1/chat/completions", {**CHAT, "tools": [TOOL], "chat_template_kwargs": {"tools": []}},
     "chat_template_kwargs.tools", "its own field"),
    ("/v1/chat/completions", {**CHAT, "continue_final_message": True},
     "continue_final_message", "add_generation_prompt=false"),
    ("/v1/chat/completions", {**CHAT, "guided_regex": "[a-z"}, "guided_regex",
     "does not compile"),
    ("/v1/chat/completions", {**CHAT, "guided_whitespace_pattern": " "},
     "guided_whitespace_pattern", "not supported"),
    ("/v1/chat/completions", {**CHAT, "prompt_logprobs": 21}, "prompt_logprobs", "at most 20"),
    ("/v1/chat/completions", {**CHAT, "modalities": ["text", "audio"]}, "modalities", "text"),
    ("/v1/chat/completions", {**CHAT, "vllm_xargs": {"k": 1}}, "vllm_xargs", "none is loaded"),
    ("/v1/chat/completions", {**CHAT, "prediction": {"type": "text", "content": "x"}},
     "prediction.type", "content"),
    ("/v1/chat/completions", {**CHAT, "prediction": {"type": "content", "content": [1]}},
     "prediction.content.0", "object"),
    ("/v1/completions", {**COMPLETION, "logits_processors": ["m:C"]}, "logits_processors",
     "--logits-processors"),
    ("/v1/chat/completions", {**CHAT, "service_tier": "flex"}, "service_tier", "tier"),
    ("/v1/completions", {**COMPLETION, "max_tokens": 0}, "max_tokens", "at least 1"),
    ("/v1/completions", {**COMPLETION, "prompt": [49152], "echo": True}, "prompt",
     "token ids must be in"),
    ("/v1/completions", {**COMPLETION, "prompt": [-1], "echo": True}, "prompt.0",
     "greater than or equal to 0"),
    ("/v1/completions", {**COMPLETION, "suffix": "end"}, "suffix", "insertion"),
    ("/v1/completions", {**COMPLETION, "n": 2, "best_of": 3}, "best_of", "rank"),
    ("/v1/completions", {**COMPLETION, "n": 2, "best_of": 1}, "best_of", "at least n"),
    ("/v1/completions", {**COMPLETION, "metadata": {"a": "b"}}, "metadata", "Unrecognized"),
    ("/v1/completions", {**COMPLETION, "frobnicate": 1}, "frobnicate", "Unrecognized"),
    ("/v1/completions", {**COMPLETION, "ttft_slo_ms": 500}, "ttft_slo_ms", "--policy slo"),
    ("/v1/chat/completions", {**CHAT, "tpot_slo_ms": 50}, "tpot_slo_ms", "--policy slo"),
    ("/v1/chat/completions", {**CHAT, "ttft_slo_ms": 0}, "ttft_slo_ms", "greater than 0"),
    ("/v1/chat/completions", {**CHAT, "stream_options": {"include_usage": True}},
     "stream_options", "stream=true"),
    ("/v1/chat/completions", {**CHAT, "stream": True, "stream_options": {"continuous": True}},
     "stream_options.continuous", "Unrecognized"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": "hi", "x": 1}]},
     "messages.0.x", "Unrecognized"),
])
def test_refusals_name_the_field(server, path, body, param, words):
    assert words in refused(post(server, path, body), param)


def greedy_chat(server, **extra) -> dict:
    r = post(server, "/v1/chat/completions", {**CHAT, **extra})
    assert r.status_code == 200, r.text
    return r.json()


def test_harmless_and_do_nothing_values_change_nothing(server):
    greedy_chat(server)  # the prompt's blocks into the prefix cache, as for every call after
    want = greedy_chat(server)["choices"][0]["message"]["content"]
    assert want
    harmless = dict(user="u-1", metadata={"team": "a"}, store=True, prompt_cache_key="k",
                    prompt_cache_retention="24h", prompt_cache_options={"ttl": "30m"},
                    safety_identifier="s-1")
    do_nothing = dict(tools=[], tool_choice="none", functions=[], function_call="none",
                      response_format={"type": "text"}, modalities=["text"], n=None,
                      service_tier="auto", reasoning_effort="none", echo=False,
                      skip_special_tokens=True, include_stop_str_in_output=False, seed=None,
                      temperature=0, top_p=None, stop=None, logit_bias=None,
                      spaces_between_special_tokens=False,  # fast tokenizers add none
                      prediction={"type": "content", "content": "Paris."})  # no speculation
    for extra in (harmless, do_nothing):
        assert greedy_chat(server, **extra)["choices"][0]["message"]["content"] == want
    r = post(server, "/v1/completions", {**COMPLETION, "n": 2, "best_of": 2, "echo": False,
                                         "suffix": "", "user": "u"})
    assert r.status_code == 200 and len(r.json()["choices"]) == 2


def test_request_id_names_the_answer(server, client):
    """vLLM's request_id: the answer's id is cmpl-/chatcmpl- and it, whole and streamed;
    two requests of one id both answer."""
    chat = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=2,
                                          extra_body={"request_id": "trace-42"})
    assert chat.id == "chatcmpl-trace-42"
    for _ in range(2):
        r = post(server, "/v1/completions", {**COMPLETION, "request_id": "trace-42",
                                             "stream": True})
        ids = {c.split('"id":"')[1].split('"')[0] for c in r.text.split("data: ")[1:-1]}
        assert ids == {"cmpl-trace-42"}
    r = post(server, "/v1/completions", {**COMPLETION, "request_id": ""})
    assert r.status_code == 400 and r.json()["error"]["param"] == "request_id"


def test_include_obfuscation_is_accepted_and_streams_as_usual(server, client):
    want = greedy_chat(server)
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=8, temperature=0, stream=True,
        stream_options={"include_usage": True, "include_obfuscation": False}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == want["choices"][0]["message"]["content"]
    assert chunks[-1].usage.completion_tokens == want["usage"]["completion_tokens"]


def test_the_openai_client_gets_400s_for_what_tidal_does_not_do(client):
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    cases = [
        (lambda: client.chat.completions.create(model=MODEL, messages=QUESTION, tools=[tool],
                                                tool_choice={"type": "function",
                                                             "function": {"name": "g"}}),
         "tool_choice.function.name"),
        (lambda: client.chat.completions.create(
            model=MODEL, messages=QUESTION,
            response_format={"type": "json_schema",
                             "json_schema": {"name": "x", "schema": {"type": "wat"}}}),
         "response_format"),
        (lambda: client.chat.completions.create(
            model=MODEL, messages=QUESTION, tools=[tool], tool_choice="required",
            response_format={"type": "json_object"}), "tool_choice"),
        (lambda: client.completions.create(model=MODEL, prompt="hi", suffix="!"), "suffix"),
        (lambda: client.completions.create(model=MODEL, prompt="hi", best_of=2), "best_of"),
        (lambda: client.chat.completions.create(model=MODEL, messages=QUESTION,
                                                logit_bias={"49152": 5}), "logit_bias"),
    ]
    for call, param in cases:
        with pytest.raises(openai.BadRequestError) as err:
            call()
        assert err.value.status_code == 400 and err.value.body["param"] == param


# ---------------------------------------------------------------------- messages

def test_text_parts_equal_the_same_text_as_a_string(client):
    parts = [{"type": "text", "text": "What is the capital"},
             {"type": "text", "text": "of France?"}]
    as_parts = client.chat.completions.create(
        model=MODEL, max_tokens=12, temperature=0,
        messages=[{"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
                  {"role": "user", "content": parts, "name": "alice"}])
    as_text = client.chat.completions.create(
        model=MODEL, max_tokens=12, temperature=0,
        messages=[{"role": "system", "content": "Be brief."},
                  {"role": "user", "content": "What is the capital\nof France?"}])
    assert as_parts.choices[0].message.content == as_text.choices[0].message.content
    assert as_parts.usage.prompt_tokens == as_text.usage.prompt_tokens


@pytest.mark.parametrize("message,param,words", [
    ({"role": "user", "content": [{"type": "text", "text": "a"},
                                  {"type": "image_url", "image_url": {"url": "http://x/y"}}]},
     "messages.1.content.1.type", "'image_url' are not supported"),
    ({"role": "user", "content": [{"type": "input_audio",
                                   "input_audio": {"data": "", "format": "wav"}}]},
     "messages.1.content.0.type", "'input_audio' are not supported"),
    ({"role": "user", "content": [{"type": "text"}]}, "messages.1.content.0.text", "string 'text'"),
    ({"role": "tool", "content": "42"}, "messages.1.tool_call_id", "needs the tool_call_id"),
    ({"role": "user", "content": "a", "tool_call_id": "c1"}, "messages.1.tool_call_id",
     "only a tool message"),
    ({"role": "user", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
     "messages.1.tool_calls", "only assistant messages"),
    ({"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "[1]"}}]},
     "messages.1.tool_calls.0.function.arguments", "JSON object"),
    ({"role": "function", "content": "1", "name": "f"}, "messages.1.role", "older form"),
    ({"role": "assistant", "content": "", "refusal": "no"}, "messages.1.refusal", "not supported"),
])
def test_unsupported_message_contents_are_400s(server, message, param, words):
    body = {**CHAT, "messages": [QUESTION[0], message]}
    assert words in refused(post(server, "/v1/chat/completions", body), param)


# ---------------------------------------------------------------------- logit_bias

def token_id(server, text: str) -> int:
    r = post(server, "/tokenize", {"model": MODEL, "prompt": text})
    assert r.status_code == 200 and r.json()["count"] == 1, r.text
    return r.json()["tokens"][0]


def test_logit_bias_forces_and_bans_tokens(server, client):
    paris = token_id(server, " Paris")
    forced = client.completions.create(model=MODEL, prompt="Hello", max_tokens=4,
                                       temperature=1.0, logit_bias={str(paris): 100},
                                       extra_body={"ignore_eos": True})
    assert forced.choices[0].text == " Paris" * 4
    plain = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=6,
                                           temperature=0, logprobs=True)
    first = plain.choices[0].logprobs.content[0].token
    first_id = token_id(server, first)
    banned = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=6,
                                            temperature=0, logprobs=True,
                                            logit_bias={str(first_id): -100})
    assert banned.choices[0].logprobs.content[0].token != first


@pytest.mark.parametrize("bias,words", [
    ({"49152": 1}, "vocabulary"), ({"-3": 1}, "vocabulary"), ({"abc": 1}, "token ids"),
    ({"5": 100.5}, "[-100, 100]"), ({"5": -101}, "[-100, 100]")])
def test_bad_logit_bias_is_a_400(server, bias, words):
    r = post(server, "/v1/completions", {**COMPLETION, "logit_bias": bias})
    assert words in refused(r, "logit_bias")


@pytest.mark.parametrize("field,value", [
    ("stop_token_ids", [49152]), ("stop_token_ids.0", [-1]), ("seed", 2**64),
    ("seed", -2**63 - 1), ("priority", 2**63), ("top_k", 2**63)])
def test_integers_outside_the_vocabulary_or_int64_are_400s_and_leave_nothing(server, field,
                                                                             value):
    """An out-of-vocabulary stop token would index past the logits; an integer beyond int64
    cannot travel to the engine core. Both are refused up front, and the server serves the
    next request."""
    r = post(server, "/v1/completions", {**COMPLETION, field.split(".")[0]: value})
    assert refused(r, field)
    assert post(server, "/v1/completions", COMPLETION).status_code == 200


def test_a_seed_whose_siblings_overflow_is_refused_offline():
    with pytest.raises(ValueError, match="seed"):
        SamplingParams(seed=2**64 - 1, n=2)
    assert SamplingParams(seed=2**64 - 2, n=2).seed == 2**64 - 2


# ---------------------------------------------------------------------- tokenize

def test_tokenize_detokenize_round_trip(server):
    text = "The quick brown fox jumps over the lazy dog. Ünïcödé ✓"
    r = post(server, "/tokenize", {"model": MODEL, "prompt": text})
    assert r.status_code == 200, r.text
    out = r.json()
    assert set(out) == {"tokens", "count", "max_model_len"}
    assert out["count"] == len(out["tokens"]) > 5
    models = httpx.get(server.url + "/v1/models", headers={"authorization": f"Bearer {KEY}"})
    assert out["max_model_len"] == models.json()["data"][0]["max_model_len"]
    back = post(server, "/detokenize", {"model": MODEL, "tokens": out["tokens"]})
    assert back.status_code == 200 and back.json() == {"prompt": text}


def test_tokenize_messages_is_the_chat_prompt(server, client):
    chat = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=1)
    full = post(server, "/tokenize", {"model": MODEL, "messages": QUESTION}).json()
    assert full["count"] == chat.usage.prompt_tokens
    bare = post(server, "/tokenize", {"model": MODEL, "messages": QUESTION,
                                      "add_generation_prompt": False}).json()
    assert bare["count"] < full["count"] and full["tokens"][:bare["count"]] == bare["tokens"]
    text = post(server, "/detokenize", {"tokens": full["tokens"]}).json()["prompt"]
    assert text.endswith("<|im_start|>assistant\n")  # special tokens kept, as vLLM does
    # vLLM's return_token_strs, continue_final_message, chat_template_kwargs
    spelled = post(server, "/tokenize", {"prompt": "the cat", "return_token_strs": True}).json()
    assert spelled["token_strs"] == ["the", "Ġcat"] and spelled["count"] == 2
    prefill = [*QUESTION, {"role": "assistant", "content": "The capital"}]
    going = post(server, "/tokenize", {"messages": prefill, "add_generation_prompt": False,
                                       "continue_final_message": True}).json()
    closed = post(server, "/tokenize", {"messages": prefill,
                                        "add_generation_prompt": False}).json()
    assert going["count"] < closed["count"] and closed["tokens"][:going["count"]] == \
        going["tokens"]
    assert refused(post(server, "/tokenize", {"messages": prefill, "continue_final_message": True}),
                   "continue_final_message")
    assert refused(post(server, "/tokenize", {"messages": QUESTION, "chat_template_kwargs": {
        "add_generation_prompt": False}}), "chat_template_kwargs.add_generation_prompt")


def test_tokenize_and_detokenize_refuse_bad_input_and_need_the_key(server):
    for path, body in (("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [1]})):
        assert post(server, path, body, key=None).status_code == 401
        assert post(server, path, body, key="nope").status_code == 401
        assert post(server, path, body).status_code == 200
        unknown = post(server, path, {**body, "model": "gpt-9"})
        assert unknown.status_code == 404 and unknown.json()["error"]["param"] == "model"
        assert "Unrecognized" in refused(post(server, path, {**body, "x": 1}), "x")
    assert refused(post(server, "/detokenize", {"tokens": [49152]}), "tokens")
    assert refused(post(server, "/tokenize", {"prompt": "a", "messages": QUESTION}), "prompt")
    assert refused(post(server, "/tokenize", {"messages": [
        {"role": "user", "content": [{"type": "image_url"}]}]}), "messages.0.content.0.type")


# ---------------------------------------------------------------------- Retry-After

def mocked_router(answer, **health):
    """A P/D router over one prefill (port 1) and one decode (port 2) instance, mocked: /health
    answers in their roles (with `health`'s fields), every other request gets
    `answer(request)`."""
    from tidal.server.pd_router import PDRouter

    def instance(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/health":
            role = "prefill" if request.url.port == 1 else "decode"
            return httpx.Response(200, json={"status": "ok", "role": role,
                                             "kv_address": "tcp://127.0.0.1:9", **health})
        return answer(request)

    router = PDRouter(["http://127.0.0.1:1"], ["http://127.0.0.1:2"])
    router.http = httpx.AsyncClient(transport=httpx.MockTransport(instance))
    return router


def test_the_router_relays_a_decode_instances_retry_after():
    """A 429 from a decode instance reaches the client through the P/D router with its
    Retry-After header (the instances are mocked: no engine needed)."""
    from fastapi.testclient import TestClient

    from tidal.server.pd_routes import build_router_app

    router = mocked_router(lambda _: httpx.Response(
        429, json=APIError("busy", 429, "rate_limit_error").body(), headers={"Retry-After": "3"}))
    with TestClient(build_router_app(router)) as http:
        r = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert r.status_code == 429 and r.headers["retry-after"] == "3"
    assert r.json()["error"]["type"] == "rate_limit_error"


def test_the_router_refuses_bodies_and_headers_over_its_limits():
    """`tidal router --max-body-bytes/--max-header-bytes`: the same 413 and 431 as a server,
    before anything is forwarded (the instances are mocked)."""
    from fastapi.testclient import TestClient

    from tidal.server.config import HttpConfig
    from tidal.server.pd_routes import build_router_app

    forwarded = []
    router = mocked_router(lambda r: forwarded.append(r.url.path) or httpx.Response(200, json={}))
    app = build_router_app(router, HttpConfig(max_body_bytes=200, max_header_bytes=1024))
    with TestClient(app) as http:
        big = http.post("/v1/completions", json={"prompt": "x" * 300, "max_tokens": 2})
        headers = http.post("/v1/completions", json={"prompt": "hi"},
                            headers={"x-pad": "y" * 2000})
    assert big.status_code == 413 and big.json()["error"]["message"]
    assert headers.status_code == 431 and headers.json()["error"]["message"]
    assert forwarded == []


def test_the_routers_health_generate_is_one_token_through_the_pair():
    """The router's /health_generate: a one-token greedy completion sent to the decode
    instance naming the prefill core, with the router's own key; 503 saying why when it
    fails; 200 without one while the decode instance is paused (the instances are mocked)."""
    from fastapi.testclient import TestClient

    from tidal.server.config import HttpConfig
    from tidal.server.pd_routes import build_router_app

    sent = []

    def answer(status):
        return lambda r: sent.append((r.url.port, r.url.path, json.loads(r.content),
                                      r.headers.get("authorization"))) or httpx.Response(
            status, json={"error": {"message": "engine core died"}})

    for status, health, want in ((200, {}, 200), (503, {}, 503), (503, {"paused": True}, 200)):
        sent.clear()
        app = build_router_app(mocked_router(answer(status), **health), HttpConfig(api_key="k"))
        with TestClient(app) as http:
            r = http.get("/health_generate")
        assert r.status_code == want, r.text
        if health:
            assert sent == []
            continue
        port, path, body, auth = sent[0]
        assert (port, path, auth) == (2, "/v1/completions", "Bearer k")
        assert body["prompt"] == [0] and body["max_tokens"] == 1
        assert body["kv_transfer_params"] == {"prefill_address": "tcp://127.0.0.1:9"}
        if want == 503:
            assert "engine core died" in r.json()["error"]["message"]
