"""End to end: a real `tidal serve` process (frontend + engine core) driven by the official
`openai` client and raw HTTP."""

from __future__ import annotations

import asyncio
import glob
import json
import os
import re
import signal
import sys
import tempfile
import time
from pathlib import Path

import httpx
import openai
import pytest

from server_fixtures import BAD, Server, finished, metric, pid_alive

KEY = "test-key"


@pytest.fixture(scope="module")
def server():
    s = Server("--api-key", KEY, "--max-pending", "40", "--omp-spin-count", "10000",
               "--served-model-name", "smollm2-135m", "small", "--enable-log-requests",
               "--enable-log-outputs", "--max-log-len", "12")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)


def post(server, path, body, key=KEY, headers=None, **kw):
    headers = {**({"authorization": f"Bearer {key}"} if key else {}), **(headers or {})}
    return httpx.post(server.url + path, headers=headers, timeout=60, **kw,
                      **({"json": body} if body is not None else {}))


QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def test_the_readmes_first_request_names_paris(server):
    """The README's curl body, read from the README itself, on a server with the default
    model, dtype and quantization: a newcomer's first answer is right."""
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    body = json.loads(re.search(r"completions .*?-d '(\{.*?\})'", readme, re.S)[1])
    assert body["messages"] == QUESTION and body["temperature"] == 0
    answer = post(server, "/v1/chat/completions", body).json()
    assert "Paris" in answer["choices"][0]["message"]["content"], answer


def test_chat_matches_the_offline_engine(client):
    from tidal import LLM, SamplingParams

    got = client.chat.completions.create(model="smollm2-135m", messages=QUESTION,
                                         max_tokens=24, temperature=0)
    llm = LLM("smollm2-135m", num_kv_blocks=64, num_threads=1)
    want = llm.chat(QUESTION, SamplingParams(max_tokens=24, temperature=0), use_tqdm=False)[0]
    assert got.choices[0].message.content == want.outputs[0].text
    assert got.choices[0].finish_reason == want.outputs[0].finish_reason
    assert got.usage.prompt_tokens == len(want.prompt_token_ids)
    assert got.usage.completion_tokens == len(want.outputs[0].token_ids)


def test_chat_stream_equals_non_stream(client):
    full = client.chat.completions.create(model="smollm2-135m", messages=QUESTION,
                                          max_tokens=16, temperature=0)
    chunks = list(client.chat.completions.create(
        model="smollm2-135m", messages=QUESTION, max_tokens=16, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == \
        full.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_completions_stream_and_not(client):
    full = client.completions.create(model="smollm2-135m", prompt="The capital of France is",
                                     max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    assert full.choices[0].finish_reason == "length" and full.usage.completion_tokens == 8
    parts = list(client.completions.create(model="smollm2-135m",
                                           prompt="The capital of France is", max_tokens=8,
                                           temperature=0, stream=True,
                                           extra_body={"ignore_eos": True}))
    assert "".join(p.choices[0].text for p in parts) == full.choices[0].text
    # vLLM's continuous_usage_stats: every chunk counts the tokens so far
    running = list(client.completions.create(
        model="smollm2-135m", prompt="The capital of France is", max_tokens=8, temperature=0,
        stream=True, extra_body={"ignore_eos": True},
        stream_options={"include_usage": True, "continuous_usage_stats": True}))
    counts = [c.usage.completion_tokens for c in running]
    assert counts == sorted(counts) and counts[-1] == 8 and len(running) == len(parts) + 1
    assert all(c.usage.prompt_tokens == full.usage.prompt_tokens for c in running)
    assert [c.usage.completion_tokens for c in running if c.choices] == list(range(1, 9))


def test_usage_counts_the_prompt_tokens_read_from_the_prefix_cache(client):
    """prompt_tokens_details.cached_tokens: none on a fresh prompt's first request; on the
    same prompt again, its whole blocks but the one holding its last token (computed, to
    sample from), whichever endpoint, streamed or not."""
    from tidal.core.config import CacheConfig

    block = CacheConfig().block_size
    ask = [{"role": "user", "content": f"Spell {os.urandom(6).hex()} backwards, then "
                                       "forwards, one letter a line."}]
    kw = dict(model="smollm2-135m", messages=ask, max_tokens=4, temperature=0)
    first = client.chat.completions.create(**kw)  # the chat template's opening may hit
    held = (first.usage.prompt_tokens - 1) // block * block
    assert first.usage.prompt_tokens_details.cached_tokens < held
    again = client.chat.completions.create(**kw)
    assert again.usage.prompt_tokens_details.cached_tokens == held
    streamed = list(client.chat.completions.create(
        **kw, stream=True, stream_options={"include_usage": True}))
    assert streamed[-1].usage.prompt_tokens_details.cached_tokens == held
    text = f"Count the letters of {os.urandom(8).hex()} one by one and then add them up:"
    cold = client.completions.create(model="smollm2-135m", prompt=text, max_tokens=2, n=2)
    warm = client.completions.create(model="smollm2-135m", prompt=text, max_tokens=2, n=2)
    assert cold.usage.prompt_tokens_details.cached_tokens == 0  # once per prompt, whatever n
    assert warm.usage.prompt_tokens_details.cached_tokens == \
        (warm.usage.prompt_tokens - 1) // block * block


def test_n_and_seed(client):
    out = client.completions.create(model="smollm2-135m", prompt="Once upon a time", n=2,
                                    max_tokens=12, temperature=1.0, seed=7,
                                    extra_body={"ignore_eos": True})
    assert sorted(c.index for c in out.choices) == [0, 1]
    again = client.completions.create(model="smollm2-135m", prompt="Once upon a time", n=2,
                                      max_tokens=12, temperature=1.0, seed=7,
                                      extra_body={"ignore_eos": True})
    assert [c.text for c in again.choices] == [c.text for c in out.choices]
    assert out.usage.completion_tokens == 24


def test_logprobs(client):
    chat = client.chat.completions.create(model="smollm2-135m", messages=QUESTION,
                                          max_tokens=4, temperature=0, logprobs=True,
                                          top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    for entry in content:  # greedy: the chosen token is the most likely alternative
        assert len(entry.top_logprobs) == 3
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)
        assert entry.token == entry.top_logprobs[0].token
    comp = client.completions.create(model="smollm2-135m", prompt="Paris is", max_tokens=3,
                                     temperature=0, logprobs=2)
    lp = comp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 3
    assert all(v <= 0 for v in lp.token_logprobs)


def test_stop_string_and_min_tokens(client):
    out = client.completions.create(model="smollm2-135m", prompt="1, 2, 3, 4,", max_tokens=20,
                                    temperature=0, stop=[" 7"])
    assert out.choices[0].finish_reason == "stop" and " 7" not in out.choices[0].text
    out = client.chat.completions.create(model="smollm2-135m", messages=QUESTION,
                                         max_tokens=30, temperature=0,
                                         extra_body={"min_tokens": 30})
    assert out.usage.completion_tokens == 30  # EOS may not come before min_tokens


def test_models_version_metrics(server, client):
    assert [m.id for m in client.models.list().data] == ["smollm2-135m", "small"]
    assert httpx.get(server.url + "/version").json()["version"]
    text = httpx.get(server.url + "/metrics").text
    for name in ("tidal:num_requests_running", "tidal:num_requests_decoding",
                 "tidal:kv_cache_usage_perc",
                 "tidal:prefix_cache_hit_rate", "tidal:num_preemptions_total",
                 "tidal:num_steps_cut_total",
                 "tidal:prompt_tokens_total", "tidal:generation_tokens_total",
                 "tidal:time_to_first_token_seconds_bucket",
                 "tidal:inter_token_latency_seconds_bucket",
                 "tidal:e2e_request_latency_seconds_bucket", "tidal:new_token_ratio"):
        assert name in text, name


def test_metrics_count_steps_and_runner_time(server, client):
    """One request of 8 tokens alone: 8 steps (its prefill samples the first), runner time
    within the request's wall time and within the steps' (what `tidal calibrate` reads)."""
    names = ("tidal:num_steps_total", "tidal:model_execute_seconds_total",
             "tidal:engine_step_seconds_total")

    def read() -> list[float]:
        time.sleep(0.7)  # the core reports every 0.5 s
        return [metric(server.url, n) for n in names]

    before = read()
    t0 = time.monotonic()
    client.completions.create(model="smollm2-135m", prompt="Once upon a time", max_tokens=8,
                              temperature=0, extra_body={"ignore_eos": True})
    wall = time.monotonic() - t0
    steps, execute, step = (b - a for a, b in zip(before, read()))
    assert steps == 8
    assert 0 < execute <= step < wall


def test_the_engine_core_gets_a_short_openmp_spin(server):
    """--omp-spin-count reaches the core process's environment, where libgomp reads it when
    the core loads torch."""
    with open(f"/proc/{server.core_pid()}/environ", "rb") as f:
        assert b"GOMP_SPINCOUNT=10000" in f.read().split(b"\0")


def test_auth(server):
    body = {"prompt": "hi", "max_tokens": 2}
    assert post(server, "/v1/completions", body, key=None).status_code == 401
    wrong = post(server, "/v1/completions", body, key="nope")
    assert wrong.status_code == 401 and wrong.json()["error"]["type"] == "authentication_error"
    assert "nope" not in wrong.text  # a wrong key is not echoed either
    assert post(server, "/v1/completions", body).status_code == 200
    log = server.output()
    assert "uvicorn" in log.lower() or "tidal" in log  # the log is there, and the key is not
    assert KEY not in log and "nope" not in log


@pytest.mark.parametrize("path,body", BAD)
def test_bad_input_is_a_400_with_an_openai_error(server, path, body):
    r = post(server, path, body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"]
    assert httpx.get(server.url + "/health").status_code == 200


def test_malformed_bodies_and_unknown_model(server):
    headers = {"authorization": f"Bearer {KEY}", "content-type": "application/json"}
    for raw in (b"{not json", b'{"prompt": "\xff\xfe"}', b"[1, 2]"):
        r = httpx.post(server.url + "/v1/completions", content=raw, headers=headers)
        assert r.status_code == 400 and "error" in r.json()
    r = post(server, "/v1/completions", {"model": "gpt-9", "prompt": "hi"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    assert r.json()["error"]["code"] == "model_not_found"


def test_disconnect_mid_stream_frees_the_blocks(server):
    body = {"prompt": "Tell me a long story.", "max_tokens": 2000, "stream": True,
            "ignore_eos": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60,
                      headers={"authorization": f"Bearer {KEY}"}) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]
        assert any(line.startswith("data: ") for line in got)
        deadline = time.monotonic() + 10  # the core reports stats twice a second
        while metric(server.url, "tidal:kv_cache_used_blocks") == 0 or \
                metric(server.url, "tidal:num_requests_decoding") != 1:
            assert time.monotonic() < deadline, "the running request holds no blocks"
            time.sleep(0.1)
    deadline = time.monotonic() + 10
    while metric(server.url, "tidal:kv_cache_used_blocks") > 0:
        assert time.monotonic() < deadline, "blocks not freed after the disconnect"
        time.sleep(0.1)
    assert metric(server.url, "tidal:num_requests_running") == 0
    assert metric(server.url, "tidal:num_requests_decoding") == 0


def test_a_non_streaming_client_that_leaves_frees_the_blocks(server):
    """2000 tokens take far longer than the wait below: only an abort frees the blocks."""
    body = {"prompt": "Tell me a long story.", "max_tokens": 2000, "ignore_eos": True}
    before, aborted = finished(server), finished(server, "abort")
    with pytest.raises(httpx.TimeoutException):
        httpx.post(server.url + "/v1/completions", json=body, timeout=2,
                   headers={"authorization": f"Bearer {KEY}"})
    deadline = time.monotonic() + 10
    while (metric(server.url, "tidal:kv_cache_used_blocks") > 0
           or metric(server.url, "tidal:num_requests_running") > 0):
        assert time.monotonic() < deadline, "blocks not freed after the client left"
        time.sleep(0.1)
    assert finished(server) == before and finished(server, "abort") == aborted + 1


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="abstract sockets: Linux")
def test_the_engine_sockets_leave_no_files(server):
    """The frontend and its cores talk over sockets in Linux's abstract namespace: none is a
    file in the temporary directory, so none outlives the server, however it ends."""
    pid = server.proc.pid
    assert not glob.glob(os.path.join(tempfile.gettempdir(), f"tidal-{pid}-*"))
    with open("/proc/net/unix") as f:
        assert f"@tidal-{pid}-" in f.read()  # yet they are there


def test_32_concurrent_streams(server):
    async def main():
        aclient = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)

        async def one(i):
            stream = await aclient.completions.create(
                model="smollm2-135m", prompt=f"Count to ten, take {i}:", max_tokens=8,
                temperature=0, stream=True, extra_body={"ignore_eos": True})
            parts = [c async for c in stream]
            return "".join(p.choices[0].text for p in parts), parts[-1].choices[0].finish_reason

        return await asyncio.gather(*(one(i) for i in range(32)))

    results = asyncio.run(main())
    assert len(results) == 32 and all(reason == "length" and text for text, reason in results)


def test_a_full_queue_answers_429_and_loses_nothing(server):
    async def main():
        async with httpx.AsyncClient(timeout=120,
                                     headers={"authorization": f"Bearer {KEY}"}) as http:
            body = {"prompt": "Count:", "max_tokens": 32, "ignore_eos": True}
            return await asyncio.gather(*(http.post(server.url + "/v1/completions", json=body)
                                          for _ in range(48)))

    responses = asyncio.run(main())
    codes = [r.status_code for r in responses]
    assert set(codes) == {200, 429} and codes.count(200) >= 40  # at most 40 in flight
    for r in responses:  # the accepted ones ran in full; the refused ones say why
        if r.status_code == 200:
            assert r.json()["usage"]["completion_tokens"] == 32
        else:
            assert r.json()["error"]["type"] == "rate_limit_error"
            assert int(r.headers["retry-after"]) >= 1
    deadline = time.monotonic() + 10
    while metric(server.url, "tidal:kv_cache_used_blocks") > 0:
        assert time.monotonic() < deadline
        time.sleep(0.1)


def test_async_scheduling_server_gives_the_same_greedy_tokens():
    """Concurrent requests through an overlapped engine core, retracting, equal the offline
    engine's (float32 on both sides: batch compositions differ between the runs)."""
    from tidal import LLM, SamplingParams

    prompts = [f"Write a list of {k} fruits:" for k in range(2, 8)]

    async def run(url):
        aclient = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0)

        async def one(p):
            out = await aclient.completions.create(model="smollm2-135m", prompt=p, max_tokens=24,
                                                   temperature=0, extra_body={"ignore_eos": True})
            return out.choices[0].text

        return await asyncio.gather(*(one(p) for p in prompts))

    # A pool too small for all six at once, and almost no decode reservation: retractions.
    overlapped = Server("--async-scheduling", "true", "--dtype", "float32",
                        "--num-kv-blocks", "12", "--block-size", "8",
                        "--init-new-token-ratio", "0.01")
    try:
        got = asyncio.run(run(overlapped.url))
        time.sleep(1)  # the core reports stats twice a second
        assert metric(overlapped.url, "tidal:num_preemptions_total") > 0
    finally:
        overlapped.stop()
    llm = LLM("smollm2-135m", dtype="float32", num_kv_blocks=64, num_threads=1)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    assert got == [o.outputs[0].text for o in llm.generate(prompts, params, use_tqdm=False)]


def test_engine_core_death_fails_fast_and_health_says_so():
    s = Server("--restart-core", "0")  # restarts: test_restart.py
    try:
        body = {"prompt": "A long story:", "max_tokens": 4000, "stream": True,
                "ignore_eos": True}
        with httpx.stream("POST", s.url + "/v1/completions", json=body, timeout=30) as r:
            lines = r.iter_lines()
            next(lines)
            os.kill(s.core_pid(), signal.SIGKILL)
            rest = [line for line in lines if line]
        assert any('"error"' in line for line in rest) and rest[-1] == "data: [DONE]"
        deadline = time.monotonic() + 10
        while (health := httpx.get(s.url + "/health")).status_code != 503:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        assert "will not be restarted" in health.json()["error"]["message"]
        assert "retry-after" not in health.headers
        t0 = time.monotonic()
        r = httpx.post(s.url + "/v1/completions", json={"prompt": "hi"}, timeout=10)
        assert r.status_code == 503 and time.monotonic() - t0 < 2
    finally:
        s.stop()


def test_sigterm_drains_running_requests_then_exits():
    s = Server("--drain-timeout", "60")
    core = s.core_pid()
    # ~3 s of decoding: the status line (logged each second) appears while it runs
    body = {"prompt": "Count:", "max_tokens": 150, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", s.url + "/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        next(lines)
        s.proc.send_signal(signal.SIGTERM)
        rest = [line for line in lines if line.startswith("data: {")]
    finish = json.loads(rest[-1][6:])["choices"][0]["finish_reason"]
    assert finish == "length"
    s.proc.wait(60)
    assert s.proc.returncode in (0, -signal.SIGTERM)  # uvicorn re-raises the signal it drained
    log = s.output()
    assert "running-decode 1" in log and "tok/s" in log  # the status line while busy
    assert "engine core stopped" in log
    deadline = time.monotonic() + 10
    while pid_alive(core):
        assert time.monotonic() < deadline, "engine core outlived the server"
        time.sleep(0.1)


def test_a_model_is_retrieved_by_name_and_an_unknown_one_is_a_404(client):
    assert client.models.retrieve("smollm2-135m").id == "smollm2-135m"
    with pytest.raises(openai.NotFoundError) as err:
        client.models.retrieve("gpt-9")
    assert err.value.body["param"] == "model" and "gpt-9" in err.value.body["message"]


def test_every_served_name_is_the_model_and_answers_carry_the_first(server, client):
    """vLLM's --served-model-name a b: requests may name either; answers, metrics and the
    schema's choices know both, the first reported."""
    assert client.models.retrieve("small").id == "small"
    reply = client.chat.completions.create(model="small", messages=QUESTION, max_tokens=2)
    assert reply.model == "smollm2-135m"
    assert client.completions.create(model="small", prompt="Hi", max_tokens=1).model == \
        "smollm2-135m"
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="large", prompt="Hi", max_tokens=1)
    assert "'smollm2-135m', 'small'" in err.value.body["message"]
    assert metric(server.url, 'tidal:num_requests_running{model_name="smollm2-135m"}') >= 0
    with pytest.raises(KeyError):
        metric(server.url, 'tidal:num_requests_running{model_name="small"}')
    schema = httpx.get(server.url + "/openapi.json", headers={"authorization": f"Bearer {KEY}"})
    assert '"small"' in schema.text


def test_answers_carry_a_fingerprint_a_null_refusal_and_the_request_id(server):
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    r = post(server, "/v1/chat/completions", chat, headers={"x-request-id": "trace-7"})
    body = r.json()
    assert r.headers["x-request-id"] == "trace-7"
    assert body["system_fingerprint"].startswith("tidal-")
    assert "refusal" in body["choices"][0]["message"]
    assert body["choices"][0]["message"]["refusal"] is None
    r = post(server, "/v1/completions", {"prompt": "Hi", "max_tokens": 2, "stream": True})
    chunks = [json.loads(line[6:]) for line in r.text.splitlines()
              if line.startswith("data: {")]
    assert chunks and all(c["system_fingerprint"] == body["system_fingerprint"]
                          for c in chunks)
    generated = r.headers["x-request-id"]
    assert len(generated) == 32 and generated != post(
        server, "/v1/completions", {"prompt": "Hi", "max_tokens": 1}).headers["x-request-id"]
    assert httpx.get(server.url + "/health").headers["x-request-id"]  # every route
    assert httpx.get(server.url + "/favicon.ico").status_code == 204  # not a 404 in a browser


def test_requests_and_outputs_are_logged_cut_to_max_log_len(server):
    """vLLM's --enable-log-requests / --enable-log-outputs / --max-log-len: a line per
    request with what it set, a line per sequence as it ends; n=2 logs both."""
    prompt = "Request logging: a prompt longer than twelve characters and tokens, " * 2
    r = post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 3, "n": 2,
                                         "temperature": 0.5, "seed": 7})
    rid = r.json()["id"].removeprefix("cmpl-")
    deadline = time.monotonic() + 10
    while f"Generated response {rid}-1" not in server.output():
        assert time.monotonic() < deadline, server.output()[-2000:]
        time.sleep(0.1)
    lines = [ln for ln in server.output().splitlines() if rid in ln]
    received = [ln for ln in lines if "Received request" in ln]
    assert len(received) == 1
    assert "prompt: 'Request logg'" in received[0]
    assert "'n': 2" in received[0] and "'seed': 7" in received[0]
    assert "'temperature': 0.5" in received[0] and "'top_p'" not in received[0]
    ids = re.search(r"prompt_token_ids: \[([^\]]*)\]", received[0]).group(1).split(", ")
    assert len(ids) == 12
    outputs = [ln for ln in lines if "Generated response" in ln]
    assert len(outputs) == 2 and all("finish_reason: length" in ln for ln in outputs)
