"""The tool-call formats beside Hermes and Llama 3's JSON (test_tools.py has those):

- Mistral's (`--tool-call-parser mistral`, or `auto` over a template that writes
  `[TOOL_CALLS]`): both of its formats read the same in any pieces, calls get the
  9-character ids its templates take, and the marker's text reaches the parser where it is
  a special token. End to end through the official client: a scripted reply (structured
  outputs) becomes tool_calls, streamed or not, and goes back through the template.
- pythonic (Llama 3.2 / 4's `[f(a=1), g()]`): lists of calls read the same in any pieces,
  their arguments as Python's literals; anything else (code, calls of attributes,
  positional arguments, deep nesting) stays text, never evaluated."""

from __future__ import annotations

import json
import re

import httpx
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as HFTokenizer

from model_fixtures import embedded_folder
from server_fixtures import Server, openai_client
from test_tools import args, collect, run, splits
from tidal.server.openai.chat_output import mistral_call_id
from tidal.server.openai.tool_parsers import (MistralParser, PythonicParser,
                                              parser_for_template)

# Mistral's v3 template, cut down: tools before the last user turn, calls as a JSON list.
TEMPLATE = """\
{%- for message in messages %}
{%- if message.role == 'user' %}{% if tools and loop.last %}[AVAILABLE_TOOLS] \
{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}[INST] {{ message.content }}[/INST]
{%- elif message.role == 'assistant' and message.tool_calls %}[TOOL_CALLS] [
{%- for call in message.tool_calls %}{% if call.id | length != 9 %}\
{{ raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}{% endif %}\
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments }}, \
"id": "{{ call.id }}"}{% if not loop.last %}, {% endif %}{% endfor %}]</s>
{%- elif message.role == 'tool' %}[TOOL_RESULTS] {"content": {{ message.content }}, \
"call_id": "{{ message.tool_call_id }}"}[/TOOL_RESULTS]
{%- else %}{{ message.content }}</s>{% endif %}
{%- endfor %}"""
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
ASK = [{"role": "user", "content": "Weather in Paris?"}]
SCRIPT = (r'Checking\.\[TOOL_CALLS\] \[\{"name": "get_weather", "arguments": '
          r'\{"city": "Paris"\}\}\]')


@settings(max_examples=120, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["f", "get_weather"]), args), min_size=1,
                max_size=3), st.text(alphabet="ab .\n", max_size=8),
       st.lists(st.integers(0, 300), max_size=8), st.booleans())
def test_both_formats_read_the_same_in_any_pieces(calls, before, cuts, named):
    if named:  # v11 on: name[ARGS]{...} after a marker each
        text = before + "".join(f"[TOOL_CALLS]{n}[ARGS]{json.dumps(a)}" for n, a in calls)
    else:  # v3: one JSON list
        text = before + "[TOOL_CALLS] " + json.dumps(
            [{"name": n, "arguments": a} for n, a in calls])
    got = collect(run(MistralParser(), splits(text, cuts)))
    assert got == (before.strip(), [(n, json.dumps(a)) for n, a in calls])


def test_what_does_not_parse_stays_text():
    for text in ("no calls here", "[TOOL_CALLS] [{\"name\": \"f\", \"argu",  # cut short
                 "[TOOL_CALLS]f{\"a\": 1}", "[TOOL_CALLS] [] ", "[TOOL_CALLS] [1]"):
        assert collect(run(MistralParser(), list(text))) == (text.strip(), [])
    assert collect(run(MistralParser(), ["[TOOL_CALLS]f[CALL_ID]a1b2c3d4e[ARGS]{}"])) == \
        ("", [("f", "{}")])
    assert parser_for_template(TEMPLATE) == "mistral"
    assert all(re.fullmatch(r"[A-Za-z0-9]{9}", mistral_call_id()) for _ in range(50))


values = st.integers(-5, 5) | st.text("ab'\"\n", max_size=4) | st.none() | st.booleans() \
    | st.lists(st.integers(0, 3), max_size=2)


@settings(max_examples=120, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["f", "get_weather"]),
                          st.dictionaries(st.sampled_from(["city", "n"]), values, max_size=2)),
                min_size=1, max_size=3), st.lists(st.integers(0, 300), max_size=8),
       st.booleans())
def test_pythonic_calls_read_the_same_in_any_pieces(calls, cuts, wrapped):
    text = "[" + ", ".join(f"{n}(" + ", ".join(f"{k}={v!r}" for k, v in a.items()) + ")"
                           for n, a in calls) + "]"
    if wrapped:  # Llama 4's markers around the list
        text = f"<|python_start|>{text}<|python_end|>"
    got = collect(run(PythonicParser(), splits(text, cuts)))
    assert got == ("", [(n, json.dumps(a)) for n, a in calls])


def test_pythonic_keeps_anything_but_literal_calls_as_text():
    for text in ("The answer is [1, 2].", "[link](https://x)", "[os.system('ls')]",
                 "[f(1)]", "[f(a=open('x'))]", "[f(**k)]", "[]", "[f(a=1)", "[" * 5000 + "]"):
        assert collect(run(PythonicParser(), list(text) if len(text) < 100 else [text])) == \
            (text.strip(), [])
    assert parser_for_template("... [func_name1(params_name1=params_value1)] ...") == \
        "pythonic"
    assert parser_for_template("{{ '<|python_start|>' }}") == "pythonic"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = tmp_path_factory.mktemp("mistral") / "template.jinja"
    path.write_text(TEMPLATE)
    s = Server("--chat-template", str(path))
    yield s
    s.stop()


def test_a_scripted_mistral_reply_becomes_calls_and_goes_back(server):
    client = openai_client(server)
    common = dict(model="smollm2-135m", messages=ASK, tools=TOOLS, temperature=0,
                  max_tokens=60, extra_body={"guided_regex": SCRIPT})
    r = client.chat.completions.create(**common)
    message = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and message.content == "Checking."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] \
        == [("get_weather", {"city": "Paris"})]
    assert re.fullmatch(r"[A-Za-z0-9]{9}", message.tool_calls[0].id)
    content, calls = "", []
    for chunk in client.chat.completions.create(**common, stream=True):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        calls += [(c.function.name, c.function.arguments) for c in delta.tool_calls or []]
    assert content == "Checking." and calls == [("get_weather", '{"city": "Paris"}')]
    # the call goes back through the template, which takes only 9-character ids
    messages = [*ASK, message.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "21"}]
    again = client.chat.completions.create(model="smollm2-135m", messages=messages,
                                           tools=TOOLS, max_tokens=2)
    assert again.usage.prompt_tokens > r.usage.prompt_tokens
    forced = client.chat.completions.create(
        model="smollm2-135m", messages=ASK, tools=TOOLS, max_tokens=40,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert re.fullmatch(r"[A-Za-z0-9]{9}", forced.choices[0].message.tool_calls[0].id)


def special_token_model(folder, tokens: list[str]):
    """A tiny random model on the embedded tokenizer with `tokens` added as special tokens
    (the last ids), and the mistral template; the folder and their ids."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = HFTokenizer.from_file(str(embedded_folder() / "tokenizer.json"))
    tok.add_special_tokens(tokens)
    ids = [tok.token_to_id(t) for t in tokens]
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(
        vocab_size=max(ids) + 1, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, bos_token_id=1,
        eos_token_id=2, max_position_embeddings=256)).save_pretrained(str(folder))
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "chat_template": TEMPLATE}))
    return folder, ids


def test_the_marker_as_a_special_token_reaches_the_parser(tmp_path):
    """A vocabulary where [TOOL_CALLS] is a special token: its text would be skipped by
    default; with tools and the mistral parser it is kept, so a reply of markers that are
    not calls stays text instead of vanishing."""
    folder, (marker,) = special_token_model(tmp_path / "mistral", ["[TOOL_CALLS]"])
    s = Server("--model", str(folder), "--dtype", "float32")
    try:
        body = dict(model="mistral", messages=ASK, max_tokens=2, logit_bias={str(marker): 100})
        with_tools = httpx.post(s.url + "/v1/chat/completions", timeout=60,
                                json={**body, "tools": TOOLS}).json()
        assert with_tools["choices"][0]["message"]["content"] == "[TOOL_CALLS][TOOL_CALLS]"
        plain = httpx.post(s.url + "/v1/chat/completions", json=body, timeout=60).json()
        assert plain["choices"][0]["message"]["content"] == ""  # skipped, as vLLM skips it
    finally:
        s.stop()


def test_reasoning_markers_that_are_special_tokens_reach_the_split(tmp_path):
    """--reasoning-parser mistral (Magistral's [THINK] ... [/THINK], special tokens): their
    text is kept for chat requests, so the reply's block becomes reasoning_content."""
    folder, (think, _) = special_token_model(tmp_path / "magistral", ["[THINK]", "[/THINK]"])
    s = Server("--model", str(folder), "--dtype", "float32", "--reasoning-parser", "mistral")
    try:
        body = dict(model="magistral", messages=ASK, max_tokens=3,
                    logit_bias={str(think): 100})
        reply = httpx.post(s.url + "/v1/chat/completions", json=body, timeout=60).json()
        message = reply["choices"][0]["message"]
        assert message["reasoning_content"] == "[THINK][THINK]" and not message["content"]
        assert reply["usage"]["completion_tokens_details"]["reasoning_tokens"] == 2
        done = httpx.post(s.url + "/v1/chat/completions", timeout=60, json={
            **body, "max_tokens": 1, "logit_bias": {str(think + 1): 100}}).json()
        assert done["choices"][0]["message"]["content"] == "[/THINK]"  # no block opened
    finally:
        s.stop()


PYTHONIC_TEMPLATE = """\
{%- for message in messages %}<|im_start|>{{ message.role }}
{%- if tools and loop.first %} If you call functions, answer only with a list in the \
format [func_name1(params_name1=params_value1), func_name2(params)]: {{ tools | tojson }}\
{%- endif %}
{% if message.tool_calls %}[{% for call in message.tool_calls %}{{ call.function.name }}(\
{%- for k, v in call.function.arguments | items %}{{ k }}={{ v | tojson }}\
{%- if not loop.last %}, {% endif %}{% endfor %}){% if not loop.last %}, {% endif %}\
{%- endfor %}]{% else %}{{ message.content }}{% endif %}<|im_end|>
{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


def test_a_scripted_pythonic_reply_becomes_calls_and_goes_back(tmp_path):
    path = tmp_path / "pythonic.jinja"
    path.write_text(PYTHONIC_TEMPLATE)
    s = Server("--chat-template", str(path))
    try:
        client = openai_client(s)
        common = dict(model="smollm2-135m", messages=ASK, tools=TOOLS, temperature=0,
                      max_tokens=40,
                      extra_body={"guided_regex": r'\[get_weather\(city="Paris"\)\]'})
        r = client.chat.completions.create(**common)
        message = r.choices[0].message
        assert r.choices[0].finish_reason == "tool_calls" and message.content is None
        assert [(c.function.name, json.loads(c.function.arguments))
                for c in message.tool_calls] == [("get_weather", {"city": "Paris"})]
        assert message.tool_calls[0].id.startswith("call_")
        streamed = [(c.function.name, c.function.arguments)
                    for chunk in client.chat.completions.create(**common, stream=True)
                    for c in chunk.choices[0].delta.tool_calls or []]
        assert streamed == [("get_weather", '{"city": "Paris"}')]
        messages = [*ASK, message.model_dump(exclude_none=True),
                    {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "21"}]
        prompt = httpx.post(s.url + "/tokenize", timeout=30, json={
            "messages": messages, "tools": TOOLS}).json()["tokens"]
        text = httpx.post(s.url + "/detokenize", json={"tokens": prompt}).json()["prompt"]
        assert '[get_weather(city="Paris")]' in text
    finally:
        s.stop()
