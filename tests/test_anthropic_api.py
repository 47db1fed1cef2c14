"""Anthropic's Messages API: the translation of a Messages body into a chat request (system
blocks, tool_use and tool_result, thinking left out, refusals naming the block), content
blocks and their stream events, and end to end with the official `anthropic` client:
create and stream agree with chat, stop sequences, a tool round trip, structured output,
count_tokens, Anthropic's error shape and `x-api-key`."""

from __future__ import annotations

import asyncio
import json

import anthropic
import httpx
import pytest
from anthropic.types import message_create_params as create_types
from pydantic import ValidationError

from server_fixtures import Server, module_server
from tidal.core.config import CacheConfig
from tidal.engine.outputs import StepUpdate
from tidal.server.anthropic.output import MessagesBody
from tidal.server.anthropic.request import MessagesRequest
from tidal.server.openai.chat_output import ChatOutputOptions
from tidal.server.openai.reasoning import THINK
from tidal.server.openai.protocol import APIError

MODEL = "smollm2-135m"
QUESTION = "What is the capital of France?"
WEATHER = {"name": "get_weather", "description": "The weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}},
                            "required": ["city"]}}
GREEDY = {"temperature": 0}  # the SDK's create() no longer names the sampling fields


# ---------------------------------------------------------------------- pure parts

def test_every_anthropic_messages_field_is_declared_or_refused():
    params = create_types.MessageCreateParamsStreaming
    fields = params.__required_keys__ | params.__optional_keys__
    assert fields - set(MessagesRequest.model_fields) - set(MessagesRequest._refused) == set()


def chat_messages(**body) -> list[dict]:
    chat = MessagesRequest.model_validate({"max_tokens": 8, **body}).chat_request()
    return [m.model_dump(exclude_none=True) for m in chat.messages]


def test_blocks_become_chat_messages():
    got = chat_messages(system=[{"type": "text", "text": "Be brief."},
                                {"type": "text", "text": "Be kind.", "cache_control": {}}],
                        messages=[
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "I should call it.", "signature": "s"},
            {"type": "text", "text": "Let me look."},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
             "input": {"city": "Paris"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1",
             "content": [{"type": "text", "text": "sunny"}]},
            {"type": "text", "text": "And tomorrow?"}]}])
    assert got == [
        {"role": "system", "content": "Be brief.\nBe kind."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Let me look.", "tool_calls": [
            {"id": "toolu_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "content": "sunny", "tool_call_id": "toolu_1"},
        {"role": "user", "content": "And tomorrow?"}]


@pytest.mark.parametrize("body, where", [
    ({"messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "data": ""}}]}]},
     "messages.0.content.0: images are not supported"),
    ({"messages": [{"role": "system", "content": "x"}]}, "messages.0.role"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [
        {"type": "web_search_20250305", "name": "web_search"}]}, "tools.0.type"),
    ({"messages": [{"role": "user", "content": "x"}], "tool_choice": {"type": "some"}},
     "tool_choice.type"),
    ({"messages": [{"role": "user", "content": "x"}], "temperature": 1.5}, "temperature"),
])
def test_what_cannot_be_honoured_is_refused_by_name(body, where):
    try:
        chat_messages(**body)
    except APIError as exc:
        said = f"{exc.param}: {exc.message}"
    except ValidationError as exc:  # where the body's model refused it
        e = exc.errors()[0]
        said = f"{(e.get('ctx') or {}).get('param') or e['loc'][0]}: {e['msg']}"
    else:
        raise AssertionError("not refused")
    assert said.startswith(where.split(":")[0]) and where in said


def run_body(pieces: list[str], stream: bool, stop_string: str | None = None,
             options: ChatOutputOptions | None = None):
    async def updates():
        for i, text in enumerate(pieces):
            last = i == len(pieces) - 1
            yield 0, StepUpdate("r", "r", 0, [i], text, last, "stop" if last else None,
                                stop_string=stop_string if last else None)

    body = MessagesBody(None, MODEL, "r", [[1, 2, 3]], 1, False,
                        options=options or ChatOutputOptions())

    async def go():
        if not stream:
            return json.loads((await body.body(updates())).body), []
        events = []
        async for e in body.events(updates(), False):
            kind, data = e.split("\n", 1)
            events.append(json.loads(data.removeprefix("data: ")))
            assert kind == f"event: {events[-1]['type']}"
        return None, events

    return asyncio.run(go())


@pytest.mark.parametrize("stream", [False, True])
def test_think_blocks_become_a_thinking_block_before_the_text(stream):
    pieces = ["<th", "ink>\nIt is", " sunny.</think>", "\n\nSun", "ny."]
    whole, events = run_body(pieces, stream, options=ChatOutputOptions(reasoning=THINK))
    if stream:
        kinds = [e["type"] for e in events]
        assert kinds[:2] == ["message_start", "ping"] and kinds[-2:] == ["message_delta",
                                                                          "message_stop"]
        blocks = [e["content_block"] for e in events if e["type"] == "content_block_start"]
        for e in events:
            if e["type"] == "content_block_delta" and e["delta"]["type"] != "signature_delta":
                key = "thinking" if e["delta"]["type"] == "thinking_delta" else "text"
                blocks[e["index"]][key] += e["delta"][key]
        assert [e["index"] for e in events if e["type"] == "content_block_stop"] == [0, 1]
        reason = events[-2]["delta"]["stop_reason"]
    else:
        blocks, reason = whole["content"], whole["stop_reason"]
        assert whole["usage"]["input_tokens"] == 3 and whole["usage"]["output_tokens"] == 5
    assert [b["type"] for b in blocks] == ["thinking", "text"]
    assert blocks[0]["thinking"] == "\nIt is sunny." and blocks[1]["text"] == "Sunny."
    assert reason == "end_turn"


@pytest.mark.parametrize("stream", [False, True])
def test_a_stop_string_is_the_stop_sequence(stream):
    whole, events = run_body(["One, two, ", "three"], stream, stop_string="four")
    delta = whole or events[-2]["delta"]
    assert delta["stop_reason"] == "stop_sequence" and delta["stop_sequence"] == "four"


# ---------------------------------------------------------------------- end to end

server, openai_client = module_server("--max-model-len", "1024")


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0)


def text_of(message) -> str:
    return "".join(b.text for b in message.content if b.type == "text")


def test_create_and_stream_give_chats_answer(client, openai_client):
    chat = openai_client.chat.completions.create(
        messages=[{"role": "user", "content": QUESTION}], model=MODEL, max_tokens=12,
        temperature=0)
    kw = dict(model=MODEL, max_tokens=12, messages=[{"role": "user", "content": QUESTION}],
              extra_body=GREEDY)
    whole = client.messages.create(**kw)
    assert text_of(whole) == chat.choices[0].message.content
    assert whole.id.startswith("msg_") and whole.type == "message" and whole.role == "assistant"
    # the same prompt as the chat's: its blocks read from the prefix cache, which Anthropic
    # counts apart from input_tokens
    read = whole.usage.cache_read_input_tokens
    block = CacheConfig().block_size
    assert read == (chat.usage.prompt_tokens - 1) // block * block > 0
    assert whole.usage.input_tokens + read == chat.usage.prompt_tokens
    assert whole.usage.cache_creation_input_tokens == 0
    assert whole.usage.output_tokens == chat.usage.completion_tokens
    assert whole.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[
        chat.choices[0].finish_reason]
    with client.messages.stream(**kw) as stream:
        events = list(stream)
        final = stream.get_final_message()
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert events[0].message.usage.cache_read_input_tokens == read  # known at the start
    assert text_of(final) == text_of(whole) and final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert final.usage.cache_read_input_tokens == read
    assert final.usage.input_tokens == whole.usage.input_tokens
    counted = client.messages.count_tokens(model=MODEL, messages=kw["messages"])
    assert counted.input_tokens == whole.usage.input_tokens + read


def test_a_stop_sequence_ends_the_text_before_it(client):
    kw = dict(model=MODEL, max_tokens=24, messages=[{"role": "user", "content": QUESTION}],
              extra_body=GREEDY)
    text = text_of(client.messages.create(**kw))
    word = text.split()[len(text.split()) // 2]  # one from the middle of the answer
    cut = client.messages.create(stop_sequences=["zzz", word], **kw)
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == word
    assert text_of(cut) == text[:text.index(word)]


def test_a_tool_use_and_its_result_continue_the_conversation(server, client):
    ask = [{"role": "user", "content": "What's the weather in Paris?"}]
    first = client.messages.create(model=MODEL, max_tokens=60, messages=ask, tools=[WEATHER],
                                   tool_choice={"type": "tool", "name": "get_weather"},
                                   extra_body=GREEDY)
    (call,) = [b for b in first.content if b.type == "tool_use"]
    assert first.stop_reason == "tool_use" and call.name == "get_weather"
    assert isinstance(call.input["city"], str) and call.id
    with client.messages.stream(model=MODEL, max_tokens=60, messages=ask, tools=[WEATHER],
                                tool_choice={"type": "tool", "name": "get_weather"},
                                extra_body=GREEDY) as stream:
        partial = "".join(e.delta.partial_json for e in stream if e.type == "content_block_delta"
                          and e.delta.type == "input_json_delta")
        streamed = stream.get_final_message()
    assert json.loads(partial) == call.input
    assert [b.input for b in streamed.content if b.type == "tool_use"] == [call.input]
    history = ask + [{"role": "assistant", "content": first.content},
                     {"role": "user", "content": [{"type": "tool_result",
                                                   "tool_use_id": call.id,
                                                   "content": "sunny, 21 C"}]}]
    second = client.messages.create(model=MODEL, max_tokens=16, messages=history,
                                    tools=[WEATHER], extra_body=GREEDY)
    assert second.stop_reason in ("end_turn", "max_tokens", "tool_use")
    # its prompt is the whole conversation: the question, the call and its result
    messages = [ask[0], {"role": "assistant", "content": None, "tool_calls": [
        {"id": call.id, "type": "function", "function": {
            "name": "get_weather", "arguments": json.dumps(call.input)}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
    tool = {"type": "function", "function": {"name": "get_weather",
                                             "description": WEATHER["description"],
                                             "parameters": WEATHER["input_schema"]}}
    counted = httpx.post(server.url + "/tokenize", json={
        "model": MODEL, "messages": messages, "tools": [tool]}).json()["count"]
    assert second.usage.input_tokens + second.usage.cache_read_input_tokens == counted


def test_an_output_format_is_followed(client):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
              "required": ["city"], "additionalProperties": False}
    message = client.messages.create(
        model=MODEL, max_tokens=60, messages=[{"role": "user", "content": "Name a city."}],
        output_config={"format": {"type": "json_schema", "schema": schema}})
    assert set(json.loads(text_of(message))) == {"city"}


@pytest.mark.parametrize("body, status, kind, words", [
    ({"messages": [{"role": "user", "content": "x"}]}, 400, "invalid_request_error",
     "max_tokens"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "document", "source": {}}]}]}, 400, "invalid_request_error",
     "messages.0.content.0: documents are not supported"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": "x"}], "mcp_servers": [{}]},
     400, "invalid_request_error", "mcp_servers"),
    ({"max_tokens": 4, "messages": []}, 400, "invalid_request_error", "messages"),
    ({"max_tokens": 4, "messages": [{"role": "system", "content": "x"}]}, 400,
     "invalid_request_error", "messages.0.role: a message's role must be user or assistant"),
    ({"max_tokens": 4, "model": "claude-x", "messages": [{"role": "user", "content": "x"}]},
     404, "not_found_error", "'claude-x' does not exist"),
])
def test_bad_requests_get_anthropics_error_shape(server, body, status, kind, words):
    r = httpx.post(server.url + "/v1/messages", json={"model": MODEL, **body})  # body's wins
    assert r.status_code == status
    assert r.json()["type"] == "error" and r.json()["error"]["type"] == kind
    assert words in r.json()["error"]["message"]
    assert "error" in httpx.post(server.url + "/v1/chat/completions", json={}).json()


def test_the_sdk_raises_on_a_refusal(client):
    with pytest.raises(anthropic.BadRequestError) as info:
        client.messages.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": "AA=="}}]}])
    assert info.value.body["error"]["type"] == "invalid_request_error"


def test_the_key_is_taken_as_x_api_key():
    keyed = Server("--api-key", "sesame")
    try:
        kw = dict(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "hi"}])
        ok = anthropic.Anthropic(base_url=keyed.url, api_key="sesame", max_retries=0)
        assert ok.messages.create(**kw).type == "message"
        bad = anthropic.Anthropic(base_url=keyed.url, api_key="wrong", max_retries=0)
        with pytest.raises(anthropic.AuthenticationError) as info:
            bad.messages.create(**kw)
        assert info.value.body["error"]["type"] == "authentication_error"
    finally:
        keyed.stop()
