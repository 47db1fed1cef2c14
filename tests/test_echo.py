"""Completions `echo` and vLLM's `prompt_logprobs` through a real server on the embedded
model (float32) and the official `openai` client: the echoed prompt's logprobs equal a
forward pass of transformers' own model, the first token's are null, `max_tokens: 0`
scores the prompt alone (what evaluation harnesses send), streaming sends the prompt first,
`n > 1` echoes each choice, and `prompt_logprobs` carry each token's rank and alternatives
on both endpoints."""

from __future__ import annotations

import httpx
import openai
import pytest
import torch

from model_fixtures import embedded_folder
from server_fixtures import module_server

MODEL = "smollm2-135m"
PROMPT = "The capital of France is Paris, and the capital of Italy is"


server, client = module_server("--dtype", "float32")


@pytest.fixture(scope="module")
def reference():
    """(prompt ids, per-position log_softmax rows) of transformers' forward pass."""
    from transformers import AutoModelForCausalLM

    from tidal.model.tokenizer import Tokenizer

    folder = embedded_folder()
    ids = Tokenizer(folder).encode(PROMPT)
    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    with torch.no_grad():
        rows = hf(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    return ids, rows


def test_echo_with_logprobs_equals_a_forward_pass(client, reference):
    ids, rows = reference
    r = client.completions.create(model=MODEL, prompt=PROMPT, echo=True, logprobs=2,
                                  max_tokens=0)
    choice = r.choices[0]
    assert choice.text == PROMPT and choice.finish_reason == "length"
    assert r.usage.completion_tokens == 0 and r.usage.prompt_tokens == len(ids)
    lp = choice.logprobs
    assert len(lp.tokens) == len(ids) and "".join(lp.tokens) == PROMPT
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for i in range(1, len(ids)):
        assert lp.token_logprobs[i] == pytest.approx(rows[i - 1, ids[i]].item(), abs=2e-3)
        top = rows[i - 1].topk(2)
        assert list(lp.top_logprobs[i].values()) == pytest.approx(top.values.tolist(), abs=2e-3)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(ids))]


def test_echo_then_output_streamed_or_not_and_with_n(client):
    common = dict(model=MODEL, prompt=PROMPT, echo=True, logprobs=0, max_tokens=4,
                  temperature=0)
    whole = client.completions.create(**common).choices[0]
    assert whole.text.startswith(PROMPT) and len(whole.text) > len(PROMPT)
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0)
    assert whole.text == PROMPT + plain.choices[0].text
    chunks = list(client.completions.create(**common, stream=True))
    assert chunks[0].choices[0].text.startswith(PROMPT)  # the prompt comes first
    assert "".join(c.choices[0].text for c in chunks) == whole.text
    streamed = [v for c in chunks for v in c.choices[0].logprobs.token_logprobs]
    assert streamed == pytest.approx(whole.logprobs.token_logprobs, abs=1e-6)
    two = client.completions.create(model=MODEL, prompt=[PROMPT, "Hello"], echo=True,
                                    max_tokens=2, n=2, temperature=1.0, seed=1)
    assert [c.text.startswith(p) for c, p in zip(two.choices, [PROMPT] * 2 + ["Hello"] * 2)] \
        == [True] * 4


def test_prompt_logprobs_on_both_endpoints(server, client, reference):
    ids, rows = reference
    r = httpx.post(server.url + "/v1/completions", timeout=60, json={
        "model": MODEL, "prompt": PROMPT, "max_tokens": 1, "prompt_logprobs": 3})
    entries = r.json()["choices"][0]["prompt_logprobs"]
    assert len(entries) == len(ids) and entries[0] is None
    for i in range(1, len(ids)):
        own = entries[i][str(ids[i])]
        assert own["logprob"] == pytest.approx(rows[i - 1, ids[i]].item(), abs=2e-3)
        assert own["rank"] == int((rows[i - 1] > rows[i - 1, ids[i]]).sum()) + 1
        for rank, t in enumerate(rows[i - 1].topk(3).indices.tolist(), 1):
            assert entries[i][str(t)]["rank"] == rank
        assert all(e["decoded_token"] for e in entries[i].values())
    chat = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
        "model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1,
        "prompt_logprobs": 0})
    body = chat.json()
    count = body["usage"]["prompt_tokens"]
    assert len(body["prompt_logprobs"]) == count and body["prompt_logprobs"][0] is None
    assert all(len(e) == 1 for e in body["prompt_logprobs"][1:])  # the token itself only
    refused = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
        "model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "stream": True,
        "prompt_logprobs": 1})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "prompt_logprobs"
    with pytest.raises(openai.BadRequestError):  # max_tokens 0 without echo
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0)
