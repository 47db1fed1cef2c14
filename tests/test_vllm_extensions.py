"""vLLM's request extensions of chat and completions, end to end on a real `tidal serve`
with the official `openai` client: cache_salt, allowed_token_ids, bad_words,
skip_special_tokens and include_stop_str_in_output, truncate_prompt_tokens, return_token_ids
and return_tokens_as_token_ids, chat echo; vLLM's per-request metrics; and /start_profile
and /stop_profile writing torch.profiler traces; SageMaker's /invocations and /ping."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time

import httpx
import openai
import pytest

from server_fixtures import metric, module_server

PROFILES = tempfile.mkdtemp(prefix="tidal-profiles-")  # --profiler-dir's traces
server, client = module_server("--profiler-dir", PROFILES)


def teardown_module() -> None:
    shutil.rmtree(PROFILES, ignore_errors=True)

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=60)


def test_cache_salt_keeps_a_prefix_to_requests_of_its_salt(client):
    """vLLM's cache_salt: the second request of a salt reads the first's blocks; another
    salt, or none, reads nothing of them."""
    text = f"List the digits of {os.urandom(8).hex()} in order and then in reverse:"

    def cached(salt: str | None) -> int:
        out = client.completions.create(model="smollm2-135m", prompt=text, max_tokens=1,
                                        extra_body=None if salt is None else {"cache_salt": salt})
        return out.usage.prompt_tokens_details.cached_tokens
    first = cached("tenant-a")
    assert first == 0 and cached("tenant-a") > 0
    assert cached("tenant-b") == 0 and cached(None) == 0
    with pytest.raises(openai.BadRequestError, match="cache_salt"):
        cached("")


def test_allowed_token_ids_are_all_the_output_holds(server, client):
    tok = post(server, "/tokenize", {"model": "smollm2-135m", "prompt": " yes no"}).json()[
        "tokens"]
    out = client.completions.create(model="smollm2-135m", prompt="Is the sky blue?",
                                    max_tokens=12, temperature=1.0, seed=3,
                                    extra_body={"allowed_token_ids": tok, "ignore_eos": True})
    assert out.usage.completion_tokens == 12
    assert set(out.choices[0].text.split()) <= {"yes", "no"}
    for bad in ([], [10**9]):
        with pytest.raises(openai.BadRequestError) as err:
            client.completions.create(model="smollm2-135m", prompt="Hi", max_tokens=2,
                                      extra_body={"allowed_token_ids": bad})
        assert err.value.body["param"] == "allowed_token_ids"


def test_special_tokens_and_the_stop_token_in_the_text_when_asked_for(client):
    """skip_special_tokens=false with include_stop_str_in_output: the reply ends with the
    chat's end-of-turn token; without the latter its text stays out (a stop token's, as
    vLLM leaves it out); by default neither shows."""
    kw = dict(model="smollm2-135m", messages=QUESTION, max_tokens=40, temperature=0)
    plain = client.chat.completions.create(**kw)
    assert plain.choices[0].finish_reason == "stop"
    answer = plain.choices[0].message.content
    raw = client.chat.completions.create(**kw, extra_body={
        "skip_special_tokens": False, "include_stop_str_in_output": True})
    assert raw.choices[0].message.content == answer + "<|im_end|>"
    for spaces in (True, False):  # a fast tokenizer puts no space between special tokens
        same = client.chat.completions.create(**kw, extra_body={
            "skip_special_tokens": False, "include_stop_str_in_output": True,
            "spaces_between_special_tokens": spaces})
        assert same.choices[0].message.content == raw.choices[0].message.content
    unskipped = client.chat.completions.create(**kw, extra_body={"skip_special_tokens": False})
    assert unskipped.choices[0].message.content == answer
    words = answer.split()
    cut = client.chat.completions.create(**kw, stop=[words[1]],
                                         extra_body={"include_stop_str_in_output": True})
    head = answer[:answer.index(words[1]) + len(words[1])]
    assert cut.choices[0].message.content == head


def test_truncate_prompt_tokens_keeps_a_prompts_last_tokens(server, client):
    """vLLM's truncate_prompt_tokens: the prompt's last k tokens run (and count, and echo);
    -1 keeps a prompt within the context as it is; 0, below -1 or over the context: 400."""
    text = "one two three four five six seven eight nine ten eleven twelve"
    ids = post(server, "/tokenize", {"model": "smollm2-135m", "prompt": text}).json()["tokens"]
    kw = dict(model="smollm2-135m", prompt=text, max_tokens=3, temperature=0)
    cut = client.completions.create(**kw, echo=True, extra_body={"truncate_prompt_tokens": 4})
    tail = client.completions.create(**{**kw, "prompt": ids[-4:]}, echo=True)
    assert cut.usage.prompt_tokens == 4 and cut.choices[0].text == tail.choices[0].text
    whole = client.completions.create(**kw, extra_body={"truncate_prompt_tokens": -1})
    assert whole.usage.prompt_tokens == len(ids)
    chat = client.chat.completions.create(model="smollm2-135m", messages=QUESTION,
                                          max_tokens=2, extra_body={"truncate_prompt_tokens": 6})
    assert chat.usage.prompt_tokens == 6
    for bad in (0, -2, 10**6):
        with pytest.raises(openai.BadRequestError) as err:
            client.completions.create(**kw, extra_body={"truncate_prompt_tokens": bad})
        assert err.value.body["param"] == "truncate_prompt_tokens"


def test_return_token_ids_gives_the_prompts_and_outputs_ids(server, client):
    """vLLM's return_token_ids: the prompt's ids (chat: at the top, in the first chunk of a
    stream; completions: on each choice, in its first chunk) and each choice's output ids,
    a stream's spread over its chunks, every id once; return_tokens_as_token_ids names the
    logprobs' tokens by id."""
    ids = post(server, "/tokenize", {"model": "smollm2-135m",
                                     "messages": QUESTION}).json()["tokens"]
    kw = dict(model="smollm2-135m", messages=QUESTION, max_tokens=8, temperature=0,
              extra_body={"return_token_ids": True, "ignore_eos": True})
    chat = client.chat.completions.create(**kw)
    out = chat.choices[0].token_ids
    assert chat.prompt_token_ids == ids and len(out) == chat.usage.completion_tokens == 8
    chunks = list(client.chat.completions.create(**kw, stream=True))
    assert chunks[0].prompt_token_ids == ids
    assert [t for c in chunks for ch in c.choices
            for t in getattr(ch, "token_ids", None) or []] == out
    plain = client.chat.completions.create(**{**kw, "extra_body": {"ignore_eos": True}})
    assert plain.choices[0].message.content == chat.choices[0].message.content
    assert getattr(plain, "prompt_token_ids", None) is None  # not unless asked for
    prompt = "The capital of France is"
    want = post(server, "/tokenize", {"model": "smollm2-135m", "prompt": prompt}).json()
    comp = dict(model="smollm2-135m", prompt=prompt, max_tokens=5, n=2, temperature=0,
                extra_body={"return_token_ids": True, "ignore_eos": True})
    whole = client.completions.create(**comp)
    assert [c.prompt_token_ids for c in whole.choices] == [want["tokens"]] * 2
    streamed = {0: [], 1: []}
    for c in client.completions.create(**comp, stream=True):
        for ch in c.choices:
            streamed[ch.index] += getattr(ch, "token_ids", None) or []
    assert [len(c.token_ids) for c in whole.choices] == [5, 5]
    assert [streamed[i] for i in (0, 1)] == [c.token_ids for c in whole.choices]
    # return_tokens_as_token_ids: logprobs name each token, and each alternative, by its id
    named = client.chat.completions.create(**{**kw, "extra_body": {
        "return_token_ids": True, "return_tokens_as_token_ids": True, "ignore_eos": True}},
        logprobs=True, top_logprobs=2)
    entries = named.choices[0].logprobs.content
    assert [e.token for e in entries] == [f"token_id:{t}" for t in out]
    assert all(a.token.startswith("token_id:") for e in entries for a in e.top_logprobs)
    texts = client.completions.create(model="smollm2-135m", prompt=prompt, max_tokens=3,
                                      temperature=0, logprobs=1,
                                      extra_body={"return_tokens_as_token_ids": True})
    assert all(t.startswith("token_id:") for t in texts.choices[0].logprobs.tokens)


def test_bad_words_keep_a_word_out_of_the_answer(client):
    kw = dict(model="smollm2-135m", messages=QUESTION, max_tokens=16, temperature=0)
    assert "Paris" in client.chat.completions.create(**kw).choices[0].message.content
    out = client.chat.completions.create(**kw, extra_body={"bad_words": ["Paris"]})
    assert "Paris" not in out.choices[0].message.content
    for bad in ([" "], ["x"] * 100):
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(**kw, extra_body={"bad_words": bad})
        assert err.value.body["param"] == "bad_words"


def test_chat_echo_starts_each_answer_with_the_message_it_continues(client):
    """vLLM's chat echo: an answer that continues the assistant's last message starts with
    it, whole or streamed; after a user's message (a generation prompt follows) nothing."""
    start = "The capital of France is"
    msgs = QUESTION + [{"role": "assistant", "content": start}]
    kw = dict(model="smollm2-135m", messages=msgs, max_tokens=6, temperature=0, n=2)
    cont = {"add_generation_prompt": False, "continue_final_message": True}
    plain = client.chat.completions.create(**kw, extra_body=cont)
    echoed = client.chat.completions.create(**kw, extra_body={**cont, "echo": True})
    for p, e in zip(plain.choices, echoed.choices):
        assert e.message.content == start + p.message.content
    assert echoed.usage.completion_tokens == plain.usage.completion_tokens  # counted as before
    texts = {0: "", 1: ""}
    for c in client.chat.completions.create(**kw, stream=True, extra_body={**cont, "echo": True}):
        for ch in c.choices:
            texts[ch.index] += ch.delta.content or ""
    assert [texts[0], texts[1]] == [c.message.content for c in echoed.choices]
    asked = dict(model="smollm2-135m", messages=QUESTION, max_tokens=6, temperature=0)
    assert (client.chat.completions.create(**asked, extra_body={"echo": True})
            .choices[0].message.content
            == client.chat.completions.create(**asked).choices[0].message.content)


def test_beam_search_gives_the_reference_searchs_beams(server, client):
    """use_beam_search: the n beams of the reference search (test_beam_search.py's), run
    here on the server's own one-token logprobs, best first; the same whole and streamed."""
    from test_beam_search import reference

    ids = post(server, "/tokenize", {"model": "smollm2-135m",
                                     "prompt": "The capital of France is"}).json()["tokens"]
    eos = post(server, "/tokenize", {"model": "smollm2-135m",
                                     "prompt": "<|im_end|>"}).json()["tokens"][-1]
    width, most = 3, 4

    def model(prefix):
        out = client.completions.create(
            model="smollm2-135m", prompt=ids + list(prefix), max_tokens=1, temperature=0,
            logprobs=2 * width + 1,
            extra_body={"return_tokens_as_token_ids": True, "ignore_eos": True})
        top = out.choices[0].logprobs.top_logprobs[0]
        return sorted(((int(k.split(":")[1]), v) for k, v in top.items()), key=lambda e: -e[1])

    want = reference(model, width, most, 1.0, stop=eos)
    kw = dict(model="smollm2-135m", prompt=ids, max_tokens=most, n=width,
              extra_body={"use_beam_search": True, "return_token_ids": True})
    got = client.completions.create(**kw)
    assert [c.token_ids for c in got.choices] == [b.token_ids for b in want]
    assert got.usage.completion_tokens == sum(len(b.token_ids) for b in want)
    streamed = {}
    for c in client.completions.create(**kw, stream=True):
        for ch in c.choices:
            streamed[ch.index] = streamed.get(ch.index, "") + ch.text
    assert [streamed[i] for i in range(width)] == [c.text for c in got.choices]
    chat = client.chat.completions.create(model="smollm2-135m", messages=QUESTION, n=2,
                                          max_tokens=6, extra_body={"use_beam_search": True})
    texts = [c.message.content for c in chat.choices]
    assert len(set(texts)) == 2 and all(texts)


@pytest.mark.parametrize("extra, param", [
    ({"use_beam_search": True, "stop": ["."]}, "stop"),
    ({"use_beam_search": True, "top_p": 0.5}, "top_p"),
    ({"use_beam_search": True, "logprobs": True}, "logprobs"),
    ({"use_beam_search": True, "response_format": {"type": "json_object"}}, "response_format"),
    ({"length_penalty": 2.0}, "length_penalty"),
    ({"use_beam_search": True, "n": 3, "allowed_token_ids": [5, 6]}, "allowed_token_ids"),
    ({"use_beam_search": True, "vllm_xargs": {"k": 1}}, "vllm_xargs"),
])
def test_beam_search_refuses_what_it_cannot_honour(server, extra, param):
    r = post(server, "/v1/chat/completions", {"model": "smollm2-135m", "messages": QUESTION,
                                              "max_tokens": 4, **extra})
    assert r.status_code == 400 and r.json()["error"]["param"] == param


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_leaving_a_beam_search_ends_its_steps(server, stream):
    """The search's steps stop with the client: nothing runs or holds blocks after, and no
    step starts later (each step's requests are aborted with it)."""
    import time

    from server_fixtures import metric

    body = {"model": "smollm2-135m", "prompt": "Tell me a long story.", "max_tokens": 400,
            "n": 4, "use_beam_search": True, "ignore_eos": True, "stream": stream}
    with pytest.raises(httpx.TimeoutException):
        with httpx.stream("POST", server.url + "/v1/completions", json=body,
                          timeout=2) as r:
            for _ in r.iter_lines():  # a stream sends its beams only at the end
                pass
    deadline = time.monotonic() + 10
    while (metric(server.url, "tidal:kv_cache_used_blocks") > 0
           or metric(server.url, "tidal:num_requests_running") > 0):
        assert time.monotonic() < deadline, "a beam step still runs after the client left"
        time.sleep(0.1)
    time.sleep(1.5)  # the core reports twice a second: a later step would show
    assert metric(server.url, "tidal:num_requests_running") == 0


def test_a_requests_chat_template_needs_the_servers_trust(client, server):
    """(--trust-request-chat-template: tests/test_custom_chat_templates.py)"""
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="smollm2-135m", messages=QUESTION, max_tokens=2,
                                       extra_body={"chat_template": "{{ messages }}"})
    assert err.value.body["param"] == "chat_template"
    assert "--trust-request-chat-template" in err.value.body["message"]
    r = post(server, "/tokenize", {"messages": QUESTION, "chat_template": "{{ messages }}"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template"


def test_request_metrics_are_vllms_per_prompt(server, client):
    """A completion of two prompts with n=2 counts as two requests, as vLLM counts them:
    their prompt and generated tokens, n and max_tokens, each sequence's time per output
    token, each phase's time (queue and prefill within the request's latency), and the
    prefix cache's lookups and hits (the same prompt again hits its full blocks)."""
    names = {k: f"tidal:{k}" for k in (
        "request_prompt_tokens_sum", "request_prompt_tokens_count",
        "request_generation_tokens_sum", "request_params_n_sum",
        "request_params_max_tokens_sum", "request_time_per_output_token_seconds_count",
        "request_queue_time_seconds_count", "request_queue_time_seconds_sum",
        "request_prefill_time_seconds_sum", "request_decode_time_seconds_count",
        "request_inference_time_seconds_count", "e2e_request_latency_seconds_sum",
        "prefix_cache_queries_total", "prefix_cache_hits_total")}

    def read() -> dict[str, float]:
        time.sleep(0.7)  # the prefix cache's counts come with the core's report (0.5 s)
        return {k: metric(server.url, name) for k, name in names.items()}

    prompt = "Tell me about the sea and the ships that sail on it, far away. " * 3
    ids = post(server, "/tokenize", {"prompt": prompt}).json()["tokens"]
    before = read()
    client.completions.create(model="smollm2-135m", prompt=[ids, ids[:5]], max_tokens=5, n=2,
                              temperature=1, extra_body={"ignore_eos": True})
    d = {k: v - before[k] for k, v in read().items()}
    assert (d["request_prompt_tokens_count"], d["request_prompt_tokens_sum"]) == \
        (2, len(ids) + 5)
    assert (d["request_generation_tokens_sum"], d["request_params_n_sum"],
            d["request_params_max_tokens_sum"]) == (20, 4, 10)
    assert d["request_time_per_output_token_seconds_count"] == 4
    for phase in ("queue", "decode", "inference"):
        assert d[f"request_{phase}_time_seconds_count"] == 2
    assert 0 <= d["request_queue_time_seconds_sum"] + d["request_prefill_time_seconds_sum"] \
        <= d["e2e_request_latency_seconds_sum"]
    assert d["prefix_cache_queries_total"] == len(ids) + 5
    before = read()
    client.completions.create(model="smollm2-135m", prompt=ids, max_tokens=1)
    d = {k: v - before[k] for k, v in read().items()}
    assert d["prefix_cache_queries_total"] == len(ids)
    assert d["prefix_cache_hits_total"] >= 16 * (len(ids) // 16 - 1)


def test_a_tally_times_each_sequence_and_each_prompt_on_its_own():
    """Two sequences of one prompt (n=2) at known times: each sequence's time per output
    token is its own (its tokens, not its sibling's), the prompt's phases are its first and
    last tokens' (the queue time the core reported within its TTFT)."""
    from types import SimpleNamespace

    from tidal.engine.outputs import StepUpdate
    from tidal.server.metrics import RequestTally, ServerMetrics

    metrics = ServerMetrics(SimpleNamespace(stats=None), "m")
    tally = RequestTally(metrics, ["r"], [7], n=2, max_tokens=5)
    tally.t0 = 0.0

    def token(seq, index, now, finished=False):
        tally.update(StepUpdate(seq, "r", index, [1], "x", finished, "length" if finished
                                else None, queue_seconds=0.5), now)
    token("r", 0, 1.0)
    token("r-1", 1, 1.0)
    token("r", 0, 2.0)
    token("r", 0, 3.0, finished=True)  # 3 tokens over 2 s: 1 s each
    token("r-1", 1, 5.0, finished=True)  # 2 tokens over 4 s
    tally.close()
    value = metrics.registry.get_sample_value
    labels = {"model_name": "m"}
    sample = {name: value(f"tidal:{name}", labels) for name in (
        "request_time_per_output_token_seconds_sum", "request_generation_tokens_sum",
        "request_queue_time_seconds_sum", "request_prefill_time_seconds_sum",
        "request_decode_time_seconds_sum", "request_inference_time_seconds_sum",
        "e2e_request_latency_seconds_sum", "time_to_first_token_seconds_count",
        "request_params_n_sum", "request_prompt_tokens_sum")}
    assert sample == {
        "request_time_per_output_token_seconds_sum": 1.0 + 4.0,
        "request_generation_tokens_sum": 5, "request_queue_time_seconds_sum": 0.5,
        "request_prefill_time_seconds_sum": 0.5, "request_decode_time_seconds_sum": 4.0,
        "request_inference_time_seconds_sum": 4.5, "e2e_request_latency_seconds_sum": 5.0,
        "time_to_first_token_seconds_count": 1, "request_params_n_sum": 2,
        "request_prompt_tokens_sum": 7}
    assert value("tidal:request_success_total", {**labels, "finished_reason": "length"}) == 2
    assert metrics.recent[0][1] == 1.0  # the dashboard's TTFT


def new_trace(seen: set[str], timeout: float = 60) -> dict:
    """The next trace file the core writes into --profiler-dir, read."""
    deadline = time.monotonic() + timeout
    while not (new := {n for n in os.listdir(PROFILES) if n.endswith(".json")} - seen) \
            and time.monotonic() < deadline:
        time.sleep(0.1)
    assert len(new) == 1, new
    name = new.pop()
    seen.add(name)
    with open(os.path.join(PROFILES, name)) as f:
        return json.load(f)


def test_a_profile_traces_the_steps_between_start_and_stop(server, client):
    """/start_profile then /stop_profile: a Chrome trace of the steps run meanwhile (their
    torch operators); with `num_steps` the trace ends by itself; refusals name the field."""
    seen = set(os.listdir(PROFILES))
    assert httpx.post(server.url + "/start_profile").status_code == 200
    client.completions.create(model="smollm2-135m", prompt="Profile me", max_tokens=4)
    assert httpx.post(server.url + "/stop_profile").status_code == 200
    names = {e.get("name", "") for e in new_trace(seen)["traceEvents"]}
    assert any(n.startswith("aten::") for n in names)
    assert post(server, "/start_profile", {"num_steps": 2}).status_code == 200
    client.completions.create(model="smollm2-135m", prompt="Again, please", max_tokens=8)
    assert new_trace(seen)["traceEvents"]  # written after two steps, no /stop_profile
    for body, param in (({"num_steps": 0}, "num_steps"), ({"output_dir": "/tmp"}, "output_dir"),
                        ({"activities": ["TPU"]}, "activities.0")):
        r = post(server, "/start_profile", body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_invocations_answers_each_body_as_its_endpoint(server):
    """SageMaker's /invocations (as vLLM serves it): a chat, a completion (streamed too) and
    an embeddings body each get their endpoint's answer; /ping is /health."""
    chat = {"messages": QUESTION, "max_tokens": 8, "temperature": 0}
    prompt = {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}
    embed = {"input": "The capital of France"}
    for body, path in ((chat, "/v1/chat/completions"), (prompt, "/v1/completions")):
        want, got = post(server, path, body).json(), post(server, "/invocations", body).json()
        assert got["object"] == want["object"] and got["choices"] == want["choices"], got
    want = post(server, "/v1/embeddings", embed).json()["data"][0]["embedding"]
    got = post(server, "/invocations", embed).json()["data"][0]["embedding"]
    assert got == pytest.approx(want, abs=1e-5)
    with httpx.stream("POST", server.url + "/invocations", json={**prompt, "stream": True},
                      timeout=60) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    text = "".join(json.loads(line)["choices"][0]["text"] for line in lines[:-1])
    assert text == post(server, "/v1/completions", prompt).json()["choices"][0]["text"]
    for method in ("GET", "POST"):
        ping = httpx.request(method, server.url + "/ping")
        assert ping.status_code == 200 and ping.json()["status"] == "ok"


def test_invocations_refuses_a_body_naming_what_is_wrong(server):
    """A body no endpoint takes: the fault of the kind its fields name (param), else the
    kinds there are; a score body reaches /v1/score, which says this model has no head."""
    for body, param in (({"messages": [], "max_tokens": 4}, "messages"),
                        ({"prompt": "Hi", "max_tokens": -1}, "max_tokens"),
                        ({"input": "Hi", "dimensions": "many"}, "dimensions")):
        r = post(server, "/invocations", body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    r = post(server, "/invocations", {"question": "Hi"})
    assert r.status_code == 400 and "`messages`" in r.json()["error"]["message"], r.text
    r = post(server, "/invocations", {"text_1": "a", "text_2": "b"})
    assert r.status_code == 400 and "no score head" in r.json()["error"]["message"], r.text
    for content in (b"{not json", b"[1, 2]"):
        r = httpx.post(server.url + "/invocations", content=content,
                       headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["type"], r.text


@pytest.mark.parametrize("task,scorer,path", [
    ("auto", None, "/v1/embeddings"), ("auto", "classifier", "/v1/embeddings"),
    ("score", "classifier", "/classify"), ("embed", "classifier", "/v1/embeddings")])
def test_a_body_two_endpoints_take_goes_to_the_one_the_server_serves(task, scorer, path):
    """{"input": ...} is both an embeddings and a classify body: a --task score server with
    a classifier head classifies it, any other embeds it (vLLM's order)."""
    import asyncio
    from types import SimpleNamespace

    from tidal.server.sagemaker import _served_first, read_invocation

    class Body:
        async def json(self):
            return {"input": "Is this spam?"}
    f = SimpleNamespace(config=SimpleNamespace(task=task),
                        client=SimpleNamespace(ready=SimpleNamespace(scorer=scorer)))
    kind, _ = asyncio.run(read_invocation(Body(), _served_first(f)))
    assert kind.path == path
