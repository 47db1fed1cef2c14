"""The Responses API: its store (bounded, expiring), the translation of input items into chat
messages, output items and their stream events, and end to end with the official client:
create and stream agree with chat, `responses.parse`, a function-tool round trip through
previous_response_id, retrieve and delete, and refusals naming the field."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest
from hypothesis import given
from hypothesis import strategies as st
from openai.types.responses import response_create_params as create_types
from pydantic import BaseModel, Field

from server_fixtures import metric, module_server
from tidal.server.openai.chat_output import Piece
from tidal.server.openai.protocol import APIError
from tidal.server.responses.output import OutputItems
from tidal.server.responses.request import ResponsesRequest, input_messages
from tidal.server.openai.schemas import FunctionDelta, ToolCallDelta
from tidal.server.responses.store import ResponseStore

MODEL = "smollm2-135m"
QUESTION = "What is the capital of France?"
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                          "required": ["city"]}}


# ---------------------------------------------------------------------- pure parts

def test_every_openai_responses_field_is_declared_or_refused():
    params = create_types.ResponseCreateParamsStreaming
    fields = params.__required_keys__ | params.__optional_keys__
    assert fields - set(ResponsesRequest.model_fields) - set(ResponsesRequest._refused) == set()


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@given(st.lists(st.tuples(st.sampled_from("abcdef"), st.integers(0, 400),
                          st.sampled_from(["put", "delete", "wait"])), max_size=40))
def test_the_store_keeps_the_newest_within_its_bytes_and_age(ops):
    clock = Clock()
    store = ResponseStore(1000, ttl=10.0, clock=clock)
    alive: dict[str, float] = {}  # id -> when it was put
    for rid, size, op in ops:
        if op == "put":
            kept = store.put(rid, b"x" * size, [])
            assert kept == (size + 2 <= 1000)  # the messages' JSON: "[]"
            alive.pop(rid, None)
            if kept:
                alive[rid] = clock.now
                assert store.get(rid).body == b"x" * size
        elif op == "delete":
            present = store.get(rid) is not None
            assert store.delete(rid) == present
            alive.pop(rid, None)
            assert store.get(rid) is None
        else:
            clock.now += 4.0
        assert 0 <= store.bytes <= 1000
        for rid_, at in alive.items():  # gone only when expired or pushed out by newer
            if clock.now - at >= 10.0:
                assert store.get(rid_) is None
    held = [r for r in alive if store.get(r) is not None]
    assert store.bytes == sum(store.get(r).size for r in held)
    assert len(store) == len(held)


def test_the_store_drops_the_oldest_first_and_expires():
    clock = Clock()
    store = ResponseStore(100, ttl=5.0, clock=clock)
    assert store.put("a", b"1" * 40, []) and store.put("b", b"2" * 40, [])
    assert store.put("c", b"3" * 40, [])  # a makes room
    assert store.get("a") is None and store.get("b") and store.get("c")
    assert not store.put("big", b"4" * 200, [])
    clock.now = 5.0
    assert store.get("b") is None and len(store) == 0 and store.bytes == 0
    assert not ResponseStore(0, 5.0).put("a", b"", [])  # a zero bound keeps nothing


def test_input_items_become_chat_messages():
    items = [{"role": "user", "content": [{"type": "input_text", "text": "a"},
                                          {"type": "input_text", "text": "b"}]},
             {"type": "reasoning", "id": "rs_1", "summary": []},
             {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
             {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{}"},
             {"type": "function_call_output", "call_id": "c1", "output": "one"},
             {"type": "message", "role": "assistant",
              "content": [{"type": "output_text", "text": "done", "annotations": []}]}]
    assert input_messages(items) == [
        {"role": "user", "content": "a\nb"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}},
            {"id": "c2", "type": "function", "function": {"name": "g", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "one"},
        {"role": "assistant", "content": "done"}]
    assert input_messages("hi") == [{"role": "user", "content": "hi"}]
    for bad, param in (([{"role": "user", "content": [{"type": "input_image"}]}],
                        "input.0.content.0"),
                       ([{"type": "web_search_call"}], "input.0.type"),
                       ([{"role": "tool", "content": "x"}], "input.0.role")):
        with pytest.raises(APIError) as err:
            input_messages(bad)
        assert err.value.param == param


def test_output_items_and_their_events():
    """Reasoning, blank text (no item), a call in two pieces, then text: three items, each
    added before its deltas and done after them, the call's arguments whole."""
    out = OutputItems()
    events = out.add(Piece(reasoning="hmm"))
    events += out.add(Piece(content="\n "))
    events += out.add(Piece(calls=[ToolCallDelta(0, "c1", "function",
                                                 FunctionDelta("f", '{"a":'))]))
    events += out.add(Piece(calls=[ToolCallDelta(0, function=FunctionDelta(arguments="1}"))]))
    events += out.add(Piece(content="ok"))
    events += out.close()
    assert [i["type"] for i in out.items] == ["reasoning", "function_call", "message"]
    assert out.items[1]["arguments"] == '{"a":1}' and out.items[1]["call_id"] == "c1"
    assert out.items[2]["content"][0]["text"] == "ok"
    assert all(i["status"] == "completed" for i in out.items)
    for index, item in enumerate(out.items):
        mine = [e["type"] for e in events if e.get("output_index") == index]
        assert mine[0] == "response.output_item.added"
        assert mine[-1] == "response.output_item.done"
    deltas = [e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta"]
    assert "".join(deltas) == '{"a":1}'


def test_a_piece_that_ends_a_call_and_starts_text_keeps_the_arguments_on_the_call():
    out = OutputItems()
    out.add(Piece(calls=[ToolCallDelta(0, "c1", "function", FunctionDelta("f", '{"a":'))]))
    out.add(Piece(content="done", calls=[ToolCallDelta(0, function=FunctionDelta(
        arguments="1}"))]))
    out.close()
    assert [i["type"] for i in out.items] == ["function_call", "message"]
    assert out.items[0]["arguments"] == '{"a":1}'
    assert out.items[1]["content"][0]["text"] == "done"


# ---------------------------------------------------------------------- end to end

server, client = module_server("--max-model-len", "1024")


def test_create_and_stream_give_chats_answer(client):
    kw = dict(model=MODEL, max_output_tokens=12, temperature=0)
    for _ in range(2):  # the second reads the prompt from the prefix cache, as all after it
        chat = client.chat.completions.create(
            messages=[{"role": "user", "content": QUESTION}], model=MODEL, max_tokens=12,
            temperature=0)
    whole = client.responses.create(input=QUESTION, **kw)
    assert whole.output_text == chat.choices[0].message.content
    assert whole.id.startswith("resp_") and whole.object == "response"
    assert whole.usage.input_tokens == chat.usage.prompt_tokens
    assert whole.usage.input_tokens_details.cached_tokens == \
        chat.usage.prompt_tokens_details.cached_tokens > 0
    assert whole.usage.output_tokens == chat.usage.completion_tokens
    assert whole.status == ("incomplete" if chat.choices[0].finish_reason == "length"
                            else "completed")
    with client.responses.stream(input=QUESTION, **kw) as stream:
        events = list(stream)
    final = events[-1].response  # response.completed's, or response.incomplete's
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == f"response.{whole.status}"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == final.output_text == whole.output_text


def test_logprobs_asked_by_include_and_top_logprobs_are_chats(client):
    """`include: ["message.output_text.logprobs"]` with `top_logprobs: 3` gives each output
    token chat's logprob and its three likeliest alternatives, whole and streamed; without
    either the text carries none. They are the text's tokens: chat's (as vLLM's) also
    report the end-of-turn token that stopped the answer, which is no text."""
    kw = dict(model=MODEL, max_output_tokens=8, temperature=0)
    answer = client.chat.completions.create(
        messages=[{"role": "user", "content": QUESTION}], model=MODEL, max_tokens=8,
        temperature=0, logprobs=True, top_logprobs=3).choices[0]
    chat = answer.logprobs.content
    if answer.finish_reason == "stop":
        assert chat[-1].token == "<|im_end|>"
        chat = chat[:-1]
    asked = dict(include=["message.output_text.logprobs"], top_logprobs=3, **kw)
    whole = client.responses.create(input=QUESTION, **asked)
    got = whole.output[-1].content[0].logprobs
    assert [e.token for e in got] == [e.token for e in chat]
    assert [e.logprob for e in got] == pytest.approx([e.logprob for e in chat], abs=1e-4)
    assert all(len(e.top_logprobs) == 3 for e in got)
    assert [[a.token for a in e.top_logprobs] for e in got] == \
        [[a.token for a in e.top_logprobs] for e in chat]
    with client.responses.stream(input=QUESTION, **asked) as stream:
        deltas = [e for e in stream if e.type == "response.output_text.delta"]
    streamed = [lp for d in deltas for lp in d.logprobs]
    assert [e.token for e in streamed] == [e.token for e in chat]
    plain = client.responses.create(input=QUESTION, **kw)
    assert not plain.output[-1].content[0].logprobs


def test_parse_follows_the_schema(client):
    class City(BaseModel):
        name: str = Field(max_length=20)
        country: str = Field(max_length=20)

    r = client.responses.parse(model=MODEL, input="Describe Paris as JSON.", text_format=City,
                               max_output_tokens=120, temperature=0)
    assert isinstance(r.output_parsed, City)


def test_a_function_call_and_its_output_continue_the_conversation(server, client):
    first = client.responses.create(model=MODEL, input="What's the weather in Paris?",
                                    tools=[WEATHER], tool_choice="required",
                                    max_output_tokens=60, temperature=0, max_tool_calls=1)
    assert first.max_tool_calls == 1  # it caps built-in tools' calls: none here
    calls = [o for o in first.output if o.type == "function_call"]
    assert calls and calls[0].name == "get_weather"
    assert isinstance(json.loads(calls[0].arguments)["city"], str)
    second = client.responses.create(
        model=MODEL, previous_response_id=first.id, tools=[WEATHER], max_output_tokens=16,
        temperature=0, input=[{"type": "function_call_output", "call_id": calls[0].call_id,
                               "output": "sunny, 21 C"}])
    assert second.previous_response_id == first.id and second.status != "failed"
    # its prompt is the whole conversation: the question, the call and its result
    messages = [{"role": "user", "content": "What's the weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": calls[0].call_id, "type": "function",
                     "function": {"name": "get_weather", "arguments": calls[0].arguments}}]},
                {"role": "tool", "tool_call_id": calls[0].call_id, "content": "sunny, 21 C"}]
    tool = {"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}
    counted = httpx.post(server.url + "/tokenize", json={
        "model": MODEL, "messages": messages, "tools": [tool]}).json()["count"]
    assert second.usage.input_tokens == counted


def test_a_streamed_call_ends_as_the_whole_one(client):
    kw = dict(model=MODEL, input="What's the weather in Paris?", tools=[WEATHER],
              tool_choice={"type": "function", "name": "get_weather"},
              max_output_tokens=60, temperature=0)
    whole = client.responses.create(**kw)
    with client.responses.stream(**kw) as stream:
        events = list(stream)
        final = stream.get_final_response()
    args = "".join(e.delta for e in events
                   if e.type == "response.function_call_arguments.delta")
    call = [o for o in final.output if o.type == "function_call"][0]
    assert args == call.arguments == [o for o in whole.output
                                      if o.type == "function_call"][0].arguments


def test_stored_responses_are_retrieved_and_deleted(client):
    r = client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=4)
    got = client.responses.retrieve(r.id)
    assert got.id == r.id and got.output_text == r.output_text
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError) as err:
        client.responses.create(model=MODEL, input="and?", previous_response_id=r.id)
    assert err.value.body["param"] == "previous_response_id"
    unstored = client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=4,
                                       store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_a_background_response_is_polled_to_its_answer_and_can_be_cancelled(server, client):
    """OpenAI's background mode: created queued, polled in progress to the answer a
    foreground request gives; cancel stops one (its blocks return), is idempotent, and
    refuses a foreground response; a cancelled one is not continued."""
    kw = dict(model=MODEL, input=QUESTION, max_output_tokens=12, temperature=0)
    want = client.responses.create(**kw)
    created = client.responses.create(**kw, background=True)
    assert created.status == "queued" and created.background is True
    deadline = time.monotonic() + 60
    while (got := client.responses.retrieve(created.id)).status in ("queued", "in_progress"):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert got.status == want.status and got.output_text == want.output_text
    assert got.usage.output_tokens == want.usage.output_tokens
    again = client.responses.create(model=MODEL, input="And of Italy?", max_output_tokens=4,
                                    previous_response_id=created.id)
    assert again.usage.input_tokens > got.usage.input_tokens  # its conversation continues
    story = "Tell me a very long story about the sea, in many chapters."
    long = client.responses.create(model=MODEL, input=story, max_output_tokens=900,
                                   background=True)
    cancelled = client.responses.cancel(long.id)
    assert cancelled.status == "cancelled" and cancelled.id == long.id
    assert client.responses.retrieve(long.id).status == "cancelled"
    assert client.responses.cancel(long.id).status == "cancelled"
    deadline = time.monotonic() + 10
    while metric(server.url, "tidal:kv_cache_used_blocks") > 0:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.cancel(want.id)
    assert "background" in err.value.body["message"]
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model=MODEL, input="and?", previous_response_id=long.id)
    assert err.value.body["param"] == "previous_response_id"


def test_truncation_auto_leaves_out_the_oldest_messages_that_do_not_fit(server, client):
    """On a server of 1,024 tokens of context: a continuation over it is a 400 unless
    truncation is auto, which drops the first turn and keeps the new input whole; the
    stored conversation stays whole."""
    long = "Here is a list of words to remember: " + " ".join(["harbour"] * 500)
    first = client.responses.create(model=MODEL, input=long, max_output_tokens=4)
    assert first.truncation == "disabled"
    follow = dict(model=MODEL, input=long + " Which word was it?", max_output_tokens=8,
                  previous_response_id=first.id)
    with pytest.raises(openai.BadRequestError):
        client.responses.create(**follow)
    cut = client.responses.create(**follow, truncation="auto")
    assert cut.truncation == "auto"
    assert 500 < cut.usage.input_tokens <= 1024 - 8  # the new input, not the first turn
    again = client.responses.create(model=MODEL, input="Thanks.", max_output_tokens=4,
                                    previous_response_id=cut.id, truncation="auto")
    assert again.truncation == "auto" and again.usage.input_tokens <= 1024 - 4


def test_truncation_keeps_a_tool_result_with_its_call():
    from model_fixtures import embedded_folder
    from tidal.model.tokenizer import Tokenizer

    tok = Tokenizer(embedded_folder())
    long = " ".join(["harbour"] * 300)
    body = ResponsesRequest.model_validate({"model": MODEL, "truncation": "auto", "input": [
        {"role": "user", "content": long},
        {"type": "function_call", "call_id": "c1", "name": "f",
         "arguments": json.dumps({"text": long})},
        {"type": "function_call_output", "call_id": "c1", "output": "ok"},
        {"role": "user", "content": "And now?"}], "instructions": "Be brief."})
    whole, conversation, ids = body.fitted([], tok, 10_000)
    assert len(whole.messages) == 5 and len(conversation) == 4
    # the result and the last message would fit 200 tokens, but not without its call
    chat, conversation, ids = body.fitted([], tok, 200)
    assert [m.role for m in chat.messages] == ["system", "user"]
    assert len(conversation) == 4 and len(ids[0]) <= 199


@pytest.mark.parametrize("extra, param", [
    ({"background": True, "store": False}, "background"),
    ({"background": True, "stream": True}, "background"),
    ({"tools": [{"type": "web_search"}]}, "tools.0.type"),
    ({"input": []}, "input"),
    ({"input": ""}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input.0.content.0"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"max_output_tokens": 5000}, "max_output_tokens"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"include": ["reasoning.encrypted_content"]}, "include"),
    ({"reasoning": {"effort": "high"}}, "reasoning.effort"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nope"}}}},
     "text.format"),
    ({"tools": [{**WEATHER, "name": "a b"}]}, "tools.0.name"),
    ({"frequency_penalty": 1.0}, "frequency_penalty"),
    ({"max_tool_calls": 0}, "max_tool_calls"),
])
def test_bad_requests_are_400s_naming_the_field(server, extra, param):
    r = httpx.post(server.url + "/v1/responses",
                   json={"model": MODEL, "input": QUESTION, **extra})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_input_that_is_not_unicode_is_a_400_naming_it(server):
    r = httpx.post(server.url + "/v1/responses", content=b'{"input": "a\\ud800"}',
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input", r.text


@pytest.mark.parametrize("api", ["responses", "chat"])
def test_an_openai_agents_run_calls_the_tool_and_answers(server, api):
    """The openai-agents SDK's loop against tidal: a forced first call (the SDK then resets
    tool_choice), the tool's result sent back, a final text answer."""
    from agents import (Agent, ModelSettings, OpenAIChatCompletionsModel, OpenAIResponsesModel,
                        Runner, function_tool, set_tracing_disabled)
    from agents.exceptions import ModelBehaviorError

    set_tracing_disabled(True)
    calls = []

    @function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        calls.append(city)
        return "sunny, 21 C"

    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    model_cls = OpenAIResponsesModel if api == "responses" else OpenAIChatCompletionsModel
    agent = Agent(name="weather", instructions="Answer briefly.", tools=[get_weather],
                  model=model_cls(model=MODEL, openai_client=client),
                  model_settings=ModelSettings(tool_choice="required", max_tokens=48,
                                               temperature=0))
    try:
        result = Runner.run_sync(agent, "What's the weather in Paris?", max_turns=4)
    except ModelBehaviorError as exc:
        # The SDK refuses a Responses answer cut at max_output_tokens (status incomplete),
        # which the tiny model's final text may be: the loop still ran through the tool.
        assert api == "responses" and "max_output_tokens" in str(exc), exc
        assert calls and all(isinstance(c, str) for c in calls)
        return
    assert calls and all(isinstance(c, str) for c in calls)
    assert isinstance(result.final_output, str) and result.final_output


def test_a_wrong_method_is_a_405_allowing_both_of_the_paths_methods(server):
    r = httpx.put(server.url + "/v1/responses/resp_x", json={})
    assert r.status_code == 405 and r.headers["allow"] == "DELETE, GET"
    assert r.json()["error"]["message"] == "Method Not Allowed"


@pytest.mark.parametrize("stream", [False, True])
def test_think_blocks_become_a_reasoning_item_whole_or_streamed(stream):
    """With --reasoning-parser, a <think> block is a reasoning item before the message."""
    import asyncio

    from tidal.engine.outputs import StepUpdate
    from tidal.server.openai.chat_output import ChatOutputOptions
    from tidal.server.openai.reasoning import THINK
    from tidal.server.responses.output import ResponseBody

    pieces = ["<th", "ink>\nIt is", " sunny.</think>", "\n\nSun", "ny."]

    async def updates():
        for i, text in enumerate(pieces):
            last = i == len(pieces) - 1
            yield 0, StepUpdate("r", "r", 0, [i], text, last, "stop" if last else None)

    class Pieces:  # token i is pieces[i]
        def decode(self, ids, skip_special_tokens=True):
            return "".join(pieces[i] for i in ids)

    kept = []
    body = ResponseBody(Pieces(), MODEL, "r", [[1, 2, 3]], 1, False,
                        options=ChatOutputOptions(reasoning=THINK),
                        source=ResponsesRequest(input="weather?"), on_done=kept.append)

    async def run():
        if not stream:
            return json.loads((await body.body(updates())).body)
        events = [json.loads(e.split("data: ", 1)[1]) async for e in body.events(updates(), False)]
        assert [e["sequence_number"] for e in events] == list(range(len(events)))
        reasoning = "".join(e["delta"] for e in events
                            if e["type"] == "response.reasoning_text.delta")
        assert reasoning == "\nIt is sunny."
        assert events[-1]["type"] == "response.completed"
        return events[-1]["response"]

    final = asyncio.run(run())
    assert [i["type"] for i in final["output"]] == ["reasoning", "message"]
    assert final["output"][0]["content"][0]["text"] == "\nIt is sunny."
    assert final["output"][1]["content"][0]["text"] == "Sunny."
    assert final["status"] == "completed" and final["usage"]["input_tokens"] == 3
    # the tokens whose text holds reasoning: "ink>\nIt is" and " sunny.</think>"
    assert final["usage"]["output_tokens_details"]["reasoning_tokens"] == 2
    assert kept == [final]


@pytest.mark.parametrize("pieces, opens, count", [
    (["<think>", "a", "b", "</think>", "c"], False, 2),  # markers are not reasoning
    (["  <think>", "a", "b"], False, 2),  # cut off before </think>: all reasoning
    (["a", "b", "</think>", "c"], True, 2),  # the prompt opened the block
    (["a", "<think>", "b"], False, 0),  # a reply that does not open with a block
    (["<think></think>", "c"], False, 0),
])
def test_reasoning_tokens_count_the_tokens_inside_the_block(pieces, opens, count):
    from tidal.server.openai.reasoning import MARKERS, reasoning_tokens

    def decode(ids):
        return "".join(pieces[i] for i in ids)

    assert reasoning_tokens(list(range(len(pieces))), decode, opens) == count
    mistral = [p.replace("<think>", "[THINK]").replace("</think>", "[/THINK]") for p in pieces]
    assert reasoning_tokens(list(range(len(pieces))), lambda ids: "".join(
        mistral[i] for i in ids), opens, MARKERS["mistral"]) == count
