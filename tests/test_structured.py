"""Structured outputs on the embedded model, through a real server and the official `openai`
client: JSON schemas (OpenAI's response_format and vLLM's fields) hold at temperature 1.0
for 20 samples, streamed or not and with n > 1; regexes, choices and Lark grammars hold; a
constraint that does not compile, is too large, fails on its first mask or outgrows the
grammar engine on its first tokens, or two at once, is a 400 naming the field; one that
fails while decoding ends with an error. Offline: a request retracted and recomputed
mid-output keeps to its grammar."""

from __future__ import annotations

import asyncio
import json
import re
import time

import httpx
import jsonschema
import pytest

from server_fixtures import module_server
from tidal import LLM, SamplingParams

MODEL = "smollm2-135m"
ASK = [{"role": "user", "content": "Describe a city as JSON."}]
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["city", "population"],
          "properties": {"city": {"type": "string", "maxLength": 24},
                         "population": {"type": "integer", "minimum": 0},
                         "coastal": {"type": "boolean"}}}


server, client = module_server()


def test_json_schema_holds_for_20_samples_at_temperature_1(client):
    texts = []
    for seed in range(4):
        r = client.chat.completions.create(
            model=MODEL, messages=ASK, n=5, temperature=1.0, seed=seed, max_tokens=150,
            response_format={"type": "json_schema",
                             "json_schema": {"name": "city", "schema": SCHEMA, "strict": True}})
        for choice in r.choices:
            assert choice.finish_reason == "stop", choice.message.content
            texts.append(choice.message.content)
    for text in texts:
        jsonschema.validate(json.loads(text), SCHEMA)
    assert len(set(texts)) > 5  # sampled, not one answer repeated


def test_json_streamed_with_n_and_vllm_fields(client):
    stream = client.chat.completions.create(
        model=MODEL, messages=ASK, n=2, temperature=1.0, seed=7, max_tokens=150, stream=True,
        extra_body={"structured_outputs": {"json": SCHEMA}})
    parts = {0: "", 1: ""}
    for chunk in stream:
        for c in chunk.choices:
            parts[c.index] += c.delta.content or ""
    for text in parts.values():
        jsonschema.validate(json.loads(text), SCHEMA)
    r = client.completions.create(model=MODEL, prompt="A JSON object:", max_tokens=100,
                                  temperature=1.0, extra_body={"guided_json": SCHEMA})
    jsonschema.validate(json.loads(r.choices[0].text), SCHEMA)
    # any object: asked for a short one (a free one runs past any max_tokens here)
    short = [{"role": "user", "content": 'Return the JSON object {"ok": true} and nothing else.'}]
    r = client.chat.completions.create(model=MODEL, messages=short, max_tokens=100,
                                       temperature=0, response_format={"type": "json_object"})
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_regex_choice_and_grammar_hold(client):
    date = r"20[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9])"
    r = client.completions.create(model=MODEL, prompt="Today's date:", n=4, temperature=1.0,
                                  max_tokens=20, extra_body={"guided_regex": date})
    for c in r.choices:
        assert re.fullmatch(date, c.text), c.text
    choices = ["red", "green", "blue"]
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Pick a colour."}], n=6,
        temperature=1.0, max_tokens=10, extra_body={"guided_choice": choices})
    assert all(c.message.content in choices for c in r.choices)
    grammar = 'start: "(" NUM (" + " NUM)* ")"\nNUM: /[1-9][0-9]?/'
    r = client.completions.create(model=MODEL, prompt="A sum:", temperature=1.0, n=3,
                                  max_tokens=30,
                                  extra_body={"structured_outputs": {"grammar": grammar}})
    for c in r.choices:
        assert re.fullmatch(r"\([1-9][0-9]?( \+ [1-9][0-9]?)*\)", c.text), c.text


OVER_BYTES = "bytes; this server takes at most 131072"
CANNOT = "cannot be followed"


@pytest.mark.parametrize("body,param,words", [
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "wat"}}}},
     "response_format", "does not compile"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format.json_schema.schema", "needs"),
    ({"guided_regex": "a(b"}, "guided_regex", "unclosed group"),
    ({"guided_choice": []}, "guided_choice", "non-empty"),
    ({"structured_outputs": {"grammar": "start: nowhere"}}, "structured_outputs.grammar",
     "does not compile"),
    ({"structured_outputs": {"xml": "<a/>"}}, "structured_outputs.xml", "not supported"),
    ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex",
     "send one"),
    # over --max-constraint-bytes (128 KiB): refused before any compilation, by size
    ({"guided_choice": [f"c{i}" for i in range(100_000)]}, "guided_choice", OVER_BYTES),
    ({"guided_regex": "(ab|cd)" * 20_000}, "guided_regex", OVER_BYTES),
    ({"guided_json": {"type": "object", "properties": {
        f"field_{i}": {"type": "string", "maxLength": 10} for i in range(4000)}}},
     "guided_json", OVER_BYTES),
    # past the parser's row limit (it would fail only once decoding reached it)
    ({"guided_choice": [f"c{i}" for i in range(2000)]}, "guided_choice", "at most 1999"),
    # compiles, but its first mask fails: a schema that is only a reference to itself
    ({"guided_json": {"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}},
     "guided_json", "does not compile"),
    # compile and mask, but outgrow the grammar engine on their first tokens: nested or
    # huge counted repetitions (a lexer of millions of states), a forced output of a
    # million tokens (the parser's items)
    ({"guided_regex": "((a{100}){100}){100}"}, "guided_regex", CANNOT),
    ({"guided_regex": "a{100000}"}, "guided_regex", CANNOT),
    ({"guided_regex": "(b|(a{1000}){1000})"}, "guided_regex", CANNOT),
    ({"structured_outputs": {"regex": "The answer: (ab){20000}"}},
     "structured_outputs.regex", CANNOT),
    ({"guided_grammar": 'start: a{1000}\na: b{1000}\nb: "x"'}, "guided_grammar", CANNOT),
    ({"guided_grammar": 'start: "x" /(a{1000}){1000}/'}, "guided_grammar", CANNOT),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": {
        "type": "object", "required": ["a"],
        "properties": {"a": {"type": "string", "pattern": "^((a{100}){100}){100}$"}}}}}},
     "response_format", CANNOT),
])
def test_bad_constraints_are_400s_naming_the_field(server, body, param, words):
    r = httpx.post(server.url + "/v1/chat/completions",
                   json={"messages": ASK, "max_tokens": 8, **body}, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and words in error["message"], error


def test_a_constraint_that_fails_while_decoding_ends_with_an_error(server):
    """A grammar whose first tokens are fine but one branch outgrows the grammar engine
    (the compile-time probe takes the other): a bias steers the model into it, and the
    request ends with an error naming the constraint, never a silent stop, and the engine
    serves the next one."""
    body = {"messages": ASK, "max_tokens": 16, "logit_bias": {"97": 100},  # "q"
            "guided_grammar": 'start: "yes yes yes" | "q" X\nX: /(a{1000}){1000}/'}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 500, r.text
    assert "constraint failed while decoding" in r.json()["error"]["message"]
    with httpx.stream("POST", server.url + "/v1/chat/completions",
                      json={**body, "stream": True}, timeout=120) as s:
        events = [line for line in s.iter_lines() if line.startswith("data: ")]
    assert any("constraint failed while decoding" in e for e in events), events[-3:]
    assert not any('"finish_reason":"stop"' in e.replace(" ", "") for e in events)
    ok = httpx.post(server.url + "/v1/chat/completions",
                    json={"messages": ASK, "max_tokens": 4, "guided_choice": ["yes", "no"]},
                    timeout=60)
    assert ok.json()["choices"][0]["message"]["content"] in ("yes", "no")


def test_a_pathological_grammar_does_not_stall_other_requests(server):
    """Regexes whose lexers would take seconds to build and run (nested repetitions): the
    engine core compiles a constraint on a worker thread before scheduling it, and the
    grammar engine's budgets end such a request with an error within a few steps, while
    other requests go on."""
    async def main(regex: str):
        async with httpx.AsyncClient(timeout=120) as http:
            slow = asyncio.create_task(http.post(server.url + "/v1/completions", json={
                "prompt": "a", "max_tokens": 32, "guided_regex": regex}))
            latencies = []
            while not slow.done():
                t0 = time.perf_counter()
                r = await http.post(server.url + "/v1/completions",
                                    json={"prompt": "Hi", "max_tokens": 1})
                assert r.status_code == 200
                latencies.append(time.perf_counter() - t0)
            return (await slow), latencies

    for regex in ("((a{100}){100}){45}", "((a{100}){100}){100}"):
        slow, latencies = asyncio.run(main(regex))
        assert slow.status_code in (400, 500), slow.text  # refused, or ended while decoding
        assert "constraint" in slow.json()["error"]["message"]
        assert max(latencies, default=0.0) < 0.3, latencies


def test_a_retracted_request_resumes_its_grammar():
    """On a pool too small for all, requests are retracted mid-output and recomputed:
    every output still matches, and each equals the same request run alone."""
    pattern = r"[a-z]{3,8}( [a-z]{3,8}){5,7}\."
    params = SamplingParams(max_tokens=64, temperature=1.0, seed=3,
                            structured=("regex", pattern))
    prompts = [f"Write words {i}:" for i in range(8)]
    # almost no decode reservation: admits more than fits, then retracts
    # float32: a recomputed prefix matches its decoded logits to the last bits, which a
    # near-tie at temperature 1 needs (bf16, where the CPU runs it by default, may differ)
    small = LLM(MODEL, dtype="float32", num_kv_blocks=12, block_size=16,
                init_new_token_ratio=0.01)
    outs = small.generate(prompts, params, use_tqdm=False)
    assert small.engine.scheduler.num_preemptions > 0  # some were retracted
    texts = [o.outputs[0].text for o in outs]
    for text in texts:
        assert re.fullmatch(pattern, text), text
    alone = LLM(MODEL, dtype="float32", num_kv_blocks=64, block_size=16)
    assert [alone.generate([p], params, use_tqdm=False)[0].outputs[0].text
            for p in prompts] == texts


def test_logprob_bytes_are_each_tokens_own_bytes(client):
    """A character split over tokens: each token's `bytes` is its part of the UTF-8, and
    together they spell the text (the token strings alone would say U+FFFD)."""
    word = "日本語"
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Say Japanese."}], max_tokens=16,
        logprobs=True, top_logprobs=2, extra_body={"guided_choice": [word]})
    entries = r.choices[0].logprobs.content
    assert r.choices[0].message.content == word
    # the stop token, one of the model's end tokens (sampled): its text is its bytes
    assert entries[-1].token in ("<|im_end|>", "<|endoftext|>")
    assert bytes(entries[-1].bytes) == entries[-1].token.encode()
    entries = entries[:-1]
    assert b"".join(bytes(e.bytes) for e in entries) == word.encode()
    partial = [e for e in entries if "\ufffd" in e.token]
    assert partial  # this tokenizer splits one of these characters
    for e in partial:
        with pytest.raises(UnicodeDecodeError):
            bytes(e.bytes).decode()
    assert all(len(e.top_logprobs) == 2 and all(a.bytes is not None for a in e.top_logprobs)
               for e in entries)


@pytest.mark.parametrize("vocab, width", [(100, 100), (100, 128), (64, 70), (49152, 49152)])
def test_a_bitmask_allows_exactly_its_set_bits(vocab, width):
    """llguidance's layout (token t: bit t % 32 of word t // 32), read without compiling a
    kernel: 0 added where allowed, -inf where not and past the mask's words."""
    import numpy as np
    import torch

    from tidal.engine.structured import penalty, shifted_bits, unpacked_bits
    from tidal.model import cpu_extension

    rng = np.random.default_rng(vocab + width)
    words = rng.integers(-2**31, 2**31, (3, (vocab + 31) // 32), dtype=np.int64)
    words = words.astype(np.int32)
    bits = np.unpackbits(words.astype("<i4").view(np.uint8), axis=1, bitorder="little")
    want = np.full((3, width), -np.inf, np.float32)
    n = min(width, bits.shape[1])
    want[:, :n][bits[:, :n] == 1] = 0.0
    t = torch.from_numpy(words)
    assert torch.equal(unpacked_bits(t).to(torch.int32), shifted_bits(t))  # GPU's way too
    got = penalty(t, width)
    assert got.dtype == torch.float32 and np.array_equal(got.numpy(), want)
    logits = torch.randn(3, width)
    kept = logits + got
    assert torch.equal(kept[got == 0], logits[got == 0])  # exactly: x + 0.0 is x
    ext = cpu_extension.extension()  # the CPU runner's one pass: the same logits
    if ext is not None:
        one_pass = logits.clone()
        ext.apply_token_bitmask(one_pass, t)
        assert torch.equal(one_pass, kept)
