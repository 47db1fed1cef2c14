"""Tool calling and reasoning, offline: chat templates render as transformers renders them
(tools, documents, template arguments, loop controls, continued final messages); the
tool-call and reasoning parsers read a reply the same however it is split into pieces;
templates without tools get them as Hermes text.

End to end (a real server on the embedded model, the official `openai` client): a named
tool choice and `required` return calls whose arguments validate against the schema;
`auto` parses a scripted Hermes reply into tool_calls, streamed or not; a whole tool round
trip; `none` leaves the reply alone; `<think>` blocks go to reasoning_content."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.utils.chat_template_utils import render_jinja_template

from server_fixtures import module_server
from tidal.model.chat_template import ChatTemplate
from tidal.server.openai.chat_output import ChatOutputOptions, ChoiceOutput
from tidal.server.openai.reasoning import MARKERS, ThinkSplitter
from tidal.server.openai.tool_parsers import HermesParser, Llama3JsonParser, RequiredCallsParser
from tidal.server.openai.structured import closed_objects
from tidal.server.openai.tools import (NamedToolChoice, Tool, template_conversation,
                                       tool_constraint)

# A template in the style of Qwen 2.5's: tools as JSON lines, calls and results as tags.
TOOL_TEMPLATE = """\
{%- set ns = namespace(system=false) -%}
{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}{% set ns.system = true %}{% endif %}
# Tools
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools><|im_end|>
{% endif %}
{%- for message in messages %}
{%- if loop.first and ns.system %}{% continue %}{% endif %}
{%- if message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant
{% generation %}{{ message.content }}{% for call in message.tool_calls %}
<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>{% endfor %}{% endgeneration %}<|im_end|>
{% elif message.role == 'tool' %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- if message.content == 'STOP' %}{% break %}{% endif %}
{%- endfor %}
{%- if documents %}{% for d in documents %}[{{ d.title }}] {{ d.text }}
{% endfor %}{% endif %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if not enable_thinking | default(true) %}<think>

</think>

{% endif %}{% endif %}"""

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city, with <units> & more",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
CALL = {"id": "c1", "type": "function",
        "function": {"name": "get_weather", "arguments": {"city": "Zürich"}}}
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Zürich?"},
    {"role": "assistant", "content": "", "tool_calls": [CALL]},
    {"role": "tool", "content": "{\"c\": 3}", "tool_call_id": "c1"},
    {"role": "assistant", "content": "It is 3 degrees"},
]
SPECIAL = {"bos_token": "<s>", "eos_token": "</s>"}


@pytest.mark.parametrize("case", [
    dict(tools=TOOLS, add_generation_prompt=True),
    dict(tools=None, add_generation_prompt=True, enable_thinking=False),
    dict(tools=TOOLS, documents=[{"title": "A", "text": "alpha"}], add_generation_prompt=True),
    dict(tools=TOOLS, add_generation_prompt=False, continue_final_message=True),
])
def test_templates_render_as_transformers_renders_them(case):
    mine = ChatTemplate(TOOL_TEMPLATE, SPECIAL).render(CONVERSATION, **case)
    theirs = render_jinja_template([CONVERSATION], chat_template=TOOL_TEMPLATE,
                                   **SPECIAL, **case)[0][0]
    assert mine == theirs
    # tojson neither escapes HTML nor sorts keys
    assert ("<units> & more" in mine) == bool(case["tools"])
    assert mine.endswith("It is 3 degrees") == bool(case.get("continue_final_message"))


def test_loop_controls_and_refusals_of_templates():
    stop = [{"role": "user", "content": "STOP"}, {"role": "user", "content": "after"}]
    assert "after" not in ChatTemplate(TOOL_TEMPLATE, SPECIAL).render(stop)
    strict = ChatTemplate("{{ raise_exception('roles must alternate') }}", SPECIAL)
    with pytest.raises(Exception, match="roles must alternate"):
        strict.render(stop)
    with pytest.raises(ValueError, match="cannot be continued"):
        ChatTemplate("{{ messages | length }}", SPECIAL).render(
            stop, add_generation_prompt=False, continue_final_message=True)


def test_templates_without_tools_get_them_as_hermes_text():
    messages = [{**m, "tool_calls": [{**CALL, "function": {**CALL["function"],
                                                            "arguments": '{"city": "Zürich"}'}}]}
                if m.get("tool_calls") else m for m in CONVERSATION]
    out, tools = template_conversation(messages, TOOLS, native=False)
    assert tools is None
    assert out[0]["role"] == "system" and out[0]["content"].startswith("Be brief.\n\n")
    assert json.dumps(TOOLS[0]) in out[0]["content"]
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}' \
           '\n</tool_call>' == out[2]["content"]
    assert out[3] == {"role": "user", "content": '<tool_response>\n{"c": 3}\n</tool_response>'}
    native, _ = template_conversation(messages, TOOLS, native=True)
    assert native[2]["tool_calls"][0]["function"]["arguments"] == {"city": "Zürich"}


# ---------------------------------------------------------------------- parsers

def run(parser, pieces: list[str]) -> list:
    events = [e for p in pieces for e in parser.feed(p)] + parser.finish()
    return events


def collect(events: list) -> tuple[str, list]:
    content = "".join(e[1] for e in events if e[0] == "content")
    return content.strip(), [e[1:] for e in events if e[0] == "call"]


def splits(text: str, cuts: list[int]) -> list[str]:
    points = sorted({c % (len(text) + 1) for c in cuts} | {0, len(text)})
    return [text[a:b] for a, b in zip(points, points[1:])]


words = st.text(alphabet="ab <>{}\n/_tl", max_size=12)
args = st.dictionaries(st.sampled_from(["city", "n"]), st.integers(0, 9) | st.text("xyz"),
                       max_size=2)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(words, st.sampled_from(["f", "get_weather"]), args), max_size=3),
       words, st.lists(st.integers(0, 400), max_size=8))
def test_hermes_reads_a_reply_the_same_in_any_pieces(parts, tail, cuts):
    text = "".join(f'{w}<tool_call>\n{json.dumps({"name": n, "arguments": a})}\n</tool_call>'
                   for w, n, a in parts) + tail
    whole = collect(run(HermesParser(), [text]))
    assert collect(run(HermesParser(), splits(text, cuts))) == whole
    assert whole[1] == [(n, json.dumps(a)) for _, n, a in parts]


def test_hermes_keeps_what_is_not_a_call_as_text():
    assert collect(run(HermesParser(), ["a <tool_call>not json</tool_call> b"])) == \
        ("a <tool_call>not json</tool_call> b", [])
    cut = '<tool_call>\n{"name": "f", "arguments": {"a": 1'  # max_tokens ended it
    assert collect(run(HermesParser(), list(cut))) == (cut, [])
    unclosed = '<tool_call>\n{"name": "f", "arguments": {"a": 1}}'
    assert collect(run(HermesParser(), list(unclosed))) == ("", [("f", '{"a": 1}')])


@settings(max_examples=60, deadline=None)
@given(st.lists(args, min_size=1, max_size=3), st.lists(st.integers(0, 300), max_size=6))
def test_llama3_json_reads_calls_in_any_pieces(calls, cuts):
    text = "<|python_tag|>" + "; ".join(json.dumps({"name": "f", "parameters": a})
                                        for a in calls)
    assert collect(run(Llama3JsonParser(), splits(text, cuts))) == \
        ("", [("f", json.dumps(a)) for a in calls])
    prose = "The weather is {fine}."
    assert collect(run(Llama3JsonParser(), splits(prose, cuts))) == (prose, [])


def test_required_calls_and_their_limit():
    text = json.dumps([{"name": "f", "arguments": {"a": 1}}, {"name": "g", "arguments": {}}])
    out = ChoiceOutput(ChatOutputOptions(tool_parser=RequiredCallsParser, parallel=False))
    out.feed(text)
    out.finish()
    assert [c.function.name for c in out.calls] == ["f"]  # parallel_tool_calls=false
    assert out.finish_reason("stop") == "tool_calls" and out.finish_reason("length") == "length"
    # cut by max_tokens: OpenAI's shape, the calls so far with the last one's arguments as
    # far as they came, never the constraint's raw text as content
    for cut, calls in (('[{"name": "f", "argu', [("f", "")]),
                       ('[{"name": "f", "arguments": {"a": 1}}, {"name": "g", "arguments": {"b',
                        [("f", '{"a": 1}'), ("g", '{"b')]),
                       ('[{"na', [])):
        assert collect(run(RequiredCallsParser(), [cut])) == ("", calls), cut
    # cut before a name ended: the one tool whose name begins so, as a named call would be
    # (none when two could be meant)
    tools = ["get_weather", "get_time", "f"]
    for cut, calls in (("", [("f", "")]), ("[", [("f", "")]), ('[{"na', [("f", "")]),
                       ('[{"name": "get_w', [("get_weather", "")]),
                       ('[{"name": "get_', []),
                       ('[{"name": "f", "arguments": {}}, {"name": "get_t',
                        [("f", "{}"), ("get_time", "")])):
        assert collect(run(RequiredCallsParser(tools[2:] if cut in ("", "[", '[{"na')
                                               else tools), [cut])) == ("", calls), cut


@pytest.mark.parametrize("parser", ["think", "mistral", "seed_oss"])
@settings(max_examples=100, deadline=None)
@given(st.data(), st.booleans(), st.booleans(), st.lists(st.integers(0, 80), max_size=6))
def test_reasoning_splits_the_same_in_any_pieces(parser, data, opens, closed, cuts):
    """Each parser's markers (--reasoning-parser): what lies between them is reasoning, in
    whatever pieces the reply streams; text made of the markers' own characters too."""
    markers = MARKERS[parser]
    chars = "".join(sorted(set(markers.open + markers.close))) + "ab \n"
    thought = data.draw(st.text(chars, max_size=20))
    while markers.close in thought:  # a removal may join the pieces of another
        thought = thought.replace(markers.close, "")
    answer = data.draw(st.text("ab <>[]\n", max_size=20))
    text = ("" if opens else markers.open) + thought + \
        (markers.close + "\n\n" + answer if closed else "")

    def split(pieces, opens=opens):
        s, r, c = ThinkSplitter(opens, markers), "", ""
        for p in pieces + [None]:
            a, b = s.finish() if p is None else s.feed(p)
            r, c = r + a, c + b
        return r, c

    reasoning, content = split([text])
    assert split(splits(text, cuts)) == (reasoning, content)
    assert reasoning == thought
    assert content == (answer.lstrip("\n") if closed else "")
    assert split(["plain answer"], False) == ("", "plain answer")


def test_tool_schemas_refuse_undeclared_properties_unless_they_allow_them():
    """Objects that declare properties and say nothing of others are closed, at any depth
    (properties, items, anyOf, $defs); an explicit additionalProperties is kept; an object
    with no properties stays open; the schema given is not changed."""
    open_ = {"type": "object", "properties": {
        "where": {"type": "object", "properties": {"city": {"type": "string"}}},
        "tags": {"type": "array", "items": {"type": "object", "properties": {"k": {}}}},
        "either": {"anyOf": [{"$ref": "#/$defs/point"}, {"type": "null"}]},
        "extra": {"type": "object", "additionalProperties": True, "properties": {"a": {}}},
        "anything": {"type": "object"}},
        "$defs": {"point": {"type": "object", "properties": {"x": {"type": "number"}}}}}
    before = json.dumps(open_)
    closed = closed_objects(open_)
    assert json.dumps(open_) == before
    props = closed["properties"]
    assert closed["additionalProperties"] is False
    assert props["where"]["additionalProperties"] is False
    assert props["tags"]["items"]["additionalProperties"] is False
    assert closed["$defs"]["point"]["additionalProperties"] is False
    assert props["extra"]["additionalProperties"] is True
    assert "additionalProperties" not in props["anything"]
    tool = Tool.model_validate({"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {"a": {}}}}})
    named = NamedToolChoice.model_validate({"type": "function", "function": {"name": "f"}})
    _, spec = tool_constraint([tool], named, True)
    assert json.loads(spec)["additionalProperties"] is False  # what the grammar is built from


# ---------------------------------------------------------------------- end to end

MODEL = "smollm2-135m"
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {"type": "object", "additionalProperties": False, "required": ["city"],
           "properties": {"city": {"type": "string", "maxLength": 20},
                          "unit": {"enum": ["celsius", "fahrenheit"]}}}
TIME = {"type": "object", "additionalProperties": False, "required": ["zone"],
        "properties": {"zone": {"type": "string", "maxLength": 12}}}
FUNCTIONS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
             {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
SCRIPT = ('Let me check\\.\\n<tool_call>\\n\\{"name": "get_weather", "arguments": '
          '\\{"city": "Paris"\\}\\}\\n</tool_call>')


server, client = module_server("--reasoning-parser", "think")


def test_a_named_tool_choice_returns_valid_calls(client):
    r = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=FUNCTIONS, n=5, temperature=1.0, seed=3,
        max_tokens=60, tool_choice={"type": "function", "function": {"name": "get_time"}})
    for choice in r.choices:
        assert choice.finish_reason == "stop" and choice.message.content is None
        (call,) = choice.message.tool_calls
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name == "get_time"
        jsonschema.validate(json.loads(call.function.arguments), TIME)
    assert len({c.message.tool_calls[0].id for c in r.choices}) == 5


def test_a_forced_call_of_a_schema_open_to_other_properties_has_only_declared_ones(client):
    """langchain's bind_tools sends parameters without additionalProperties: a forced call
    must still end, its arguments the declared properties only."""
    loose = {"type": "object", "required": ["city"],
             "properties": {"city": {"type": "string", "maxLength": 20}}}
    r = client.chat.completions.create(
        model=MODEL, messages=ASK, n=5, temperature=1.0, seed=4, max_tokens=60,
        tools=[{"type": "function", "function": {"name": "get_weather", "parameters": loose}}],
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    for choice in r.choices:
        assert choice.finish_reason == "stop"
        assert set(json.loads(choice.message.tool_calls[0].function.arguments)) == {"city"}


def test_langchain_bind_tools_with_tool_choice_any_returns_a_call(server):
    """What langchain-openai users write: a pydantic tool (its schema without
    additionalProperties), tool_choice "any" (sent as "required")."""
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel, Field

    class GetWeather(BaseModel):
        """The weather in a city."""

        city: str = Field(max_length=20, description="the city")

    llm = ChatOpenAI(model=MODEL, base_url=server.url + "/v1", api_key="none", temperature=0,
                     max_tokens=60, max_retries=0)
    reply = llm.bind_tools([GetWeather], tool_choice="any").invoke("What's the weather in Paris?")
    (call,) = reply.tool_calls
    assert call["name"] == "GetWeather" and set(call["args"]) == {"city"}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_a_forced_call_cut_by_max_tokens_has_one_shape_named_or_required(client, stream):
    """OpenAI's: finish_reason length, no content, the call in tool_calls with the arguments
    generated so far, whether the call was named or `required`."""
    shapes = []
    # each cut inside its arguments (a required list first writes the call's name), and a
    # required list cut inside the name: the call is named all the same
    for choice, most in (({"type": "function", "function": {"name": "get_weather"}}, 6),
                         ("required", 16), ("required", 3)):
        r = client.chat.completions.create(model=MODEL, messages=ASK, tools=FUNCTIONS[:1],
                                           tool_choice=choice, max_tokens=most, stream=stream)
        if stream:
            content, calls, finish = "", {}, None
            for chunk in r:
                delta = chunk.choices[0].delta
                content += delta.content or ""
                for d in delta.tool_calls or []:
                    entry = calls.setdefault(d.index, ["", ""])
                    entry[0] += d.function.name or ""
                    entry[1] += d.function.arguments or ""
                finish = chunk.choices[0].finish_reason or finish
            shape = (content or None, [tuple(c) for c in calls.values()], finish)
        else:
            m = r.choices[0].message
            shape = (m.content, [(c.function.name, c.function.arguments)
                                 for c in m.tool_calls or []], r.choices[0].finish_reason)
        assert shape[0] is None and shape[2] == "length", shape
        assert [name for name, _ in shape[1]] == ["get_weather"], shape
        with pytest.raises(ValueError):  # unfinished
            json.loads(shape[1][0][1])
        shapes.append(shape)
    assert all(args.lstrip().startswith("{") for _, ((_, args),), _ in shapes[:2]), shapes
    assert shapes[2][1] == [("get_weather", "")], shapes


def test_required_returns_calls_of_the_tools_streamed_or_not(client):
    common = dict(model=MODEL, messages=ASK, tools=FUNCTIONS, tool_choice="required",
                  temperature=1.0, seed=5, max_tokens=120)
    whole = client.chat.completions.create(**common)
    calls = whole.choices[0].message.tool_calls
    assert whole.choices[0].finish_reason == "tool_calls" and calls
    for call in calls:
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    streamed = {}
    for chunk in client.chat.completions.create(**common, stream=True):
        for d in chunk.choices[0].delta.tool_calls or []:
            entry = streamed.setdefault(d.index, {"name": "", "arguments": ""})
            entry["name"] += d.function.name or ""
            entry["arguments"] += d.function.arguments or ""
    assert [(c["name"], c["arguments"]) for c in streamed.values()] == \
        [(c.function.name, c.function.arguments) for c in calls]
    one = client.chat.completions.create(**{**common, "seed": 6}, parallel_tool_calls=False)
    assert len(one.choices[0].message.tool_calls) == 1


def test_auto_parses_a_hermes_reply_streamed_or_not(client):
    common = dict(model=MODEL, messages=ASK, tools=FUNCTIONS, temperature=0, max_tokens=60,
                  extra_body={"guided_regex": SCRIPT})
    r = client.chat.completions.create(**common)
    message = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and message.content == "Let me check."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] \
        == [("get_weather", {"city": "Paris"})]
    content, calls, finish = "", [], None
    for chunk in client.chat.completions.create(**common, stream=True):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        calls += [(c.id, c.function.name, c.function.arguments) for c in delta.tool_calls or []]
        finish = chunk.choices[0].finish_reason or finish
    assert content == "Let me check." and finish == "tool_calls"
    assert [c[1:] for c in calls] == [("get_weather", message.tool_calls[0].function.arguments)]
    plain = client.chat.completions.create(**{**common, "tool_choice": "none"})
    assert plain.choices[0].message.tool_calls is None
    assert "<tool_call>" in plain.choices[0].message.content
    # the template still shows the tools (vLLM's default); only the parsing is off
    bare = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=1)
    assert plain.usage.prompt_tokens == r.usage.prompt_tokens > bare.usage.prompt_tokens


def test_a_tool_round_trip(server, client):
    first = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=FUNCTIONS, max_tokens=60, temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    call = first.choices[0].message.tool_calls[0]
    messages = [*ASK, first.choices[0].message.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": call.id, "content": '{"celsius": 21}'}]
    second = client.chat.completions.create(model=MODEL, messages=messages, tools=FUNCTIONS,
                                            max_tokens=16, temperature=0)
    assert second.choices[0].message.content
    r = httpx.post(server.url + "/tokenize", timeout=30,
                   json={"model": MODEL, "messages": messages, "tools": FUNCTIONS})
    d = httpx.post(server.url + "/detokenize", json={"model": MODEL, "tokens": r.json()["tokens"]},
                   timeout=30)
    prompt = d.json()["prompt"]
    assert f'{{"name": "get_weather", "arguments": {call.function.arguments}}}' in prompt
    assert '<tool_response>\n{"celsius": 21}\n</tool_response>' in prompt
    assert second.usage.prompt_tokens == r.json()["count"]


def test_think_blocks_become_reasoning_content(client):
    common = dict(model=MODEL, messages=ASK, temperature=0, max_tokens=40,
                  extra_body={"guided_regex": "<think>\\nIt is sunny\\.</think>\\n\\nSunny\\."})
    whole = client.chat.completions.create(**common)
    message = whole.choices[0].message
    assert (message.reasoning_content, message.content) == ("\nIt is sunny.", "Sunny.")
    # OpenAI's count of them: the tokens inside the block, its markers and the answer out
    reasoning = whole.usage.completion_tokens_details.reasoning_tokens
    assert 3 <= reasoning <= whole.usage.completion_tokens - 3
    parts = {"reasoning_content": "", "content": ""}
    for chunk in client.chat.completions.create(**common, stream=True,
                                                stream_options={"include_usage": True}):
        if not chunk.choices:  # the usage chunk
            assert chunk.usage.completion_tokens_details.reasoning_tokens == reasoning
            continue
        delta = chunk.choices[0].delta.model_dump()
        for key in parts:
            parts[key] += delta.get(key) or ""
    assert parts == {"reasoning_content": "\nIt is sunny.", "content": "Sunny."}
    hidden = client.chat.completions.create(
        **{**common, "extra_body": {**common["extra_body"], "include_reasoning": False}})
    assert getattr(hidden.choices[0].message, "reasoning_content", None) is None
    assert hidden.choices[0].message.content == "Sunny."


def test_continue_final_message_writes_on(server, client):
    messages = [*ASK, {"role": "assistant", "content": "The weather in Paris is"}]
    r = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=8, temperature=0,
        extra_body={"continue_final_message": True, "add_generation_prompt": False})
    ids = httpx.post(server.url + "/tokenize", timeout=30, json={
        "model": MODEL, "messages": messages, "add_generation_prompt": False}).json()["tokens"]
    assert r.usage.prompt_tokens < len(ids)  # no end-of-turn after the assistant's words
    text = httpx.post(server.url + "/detokenize", json={"model": MODEL, "tokens": ids},
                      timeout=30).json()["prompt"]
    prefix = text[:text.rindex("The weather in Paris is") + len("The weather in Paris is")]
    same = client.completions.create(model=MODEL, prompt=prefix, max_tokens=8, temperature=0,
                                     extra_body={"add_special_tokens": False})
    assert r.choices[0].message.content == same.choices[0].text
