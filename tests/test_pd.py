"""End to end: `tidal serve --pd 1P1D` (a prefill instance, a decode instance and the router,
one engine thread each) driven by the official `openai` and `anthropic` clients: generation,
Responses (continued on the decode instance that stored them), embeddings and scores (on
the prefill instance), and the failure cases."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import anthropic
import httpx
import openai
import pytest

from server_fixtures import BAD, Server, metric

PROMPTS = ["The capital of France is", "Once upon a time", "1, 2, 3, 4,"]
CHAT = [{"role": "user", "content": "What is the capital of France?"}]
LONG = "Tell me everything about the history of the sea. " * 150  # ~1500 tokens


def instances(router_url: str) -> tuple[str, str]:
    health = httpx.get(router_url + "/health").json()
    return health["prefill"][0], health["decode"][0]


def core_pid(url: str) -> int:
    return httpx.get(url + "/health").json()["engine_core_pid"]


def used_blocks(url: str) -> float:
    return metric(url, "tidal:kv_cache_used_blocks")


def wait_until(cond, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def answers(url: str) -> list[str]:
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    out = [client.completions.create(model="smollm2-135m", prompt=p, max_tokens=16,
                                     temperature=0).choices[0].text for p in PROMPTS]
    out.append(client.chat.completions.create(model="smollm2-135m", messages=CHAT,
                                              max_tokens=16, temperature=0)
               .choices[0].message.content)
    stream = client.completions.create(model="smollm2-135m", prompt=PROMPTS[1], max_tokens=16,
                                       temperature=0, stream=True)
    out.append("".join(c.choices[0].text for c in stream if c.choices))
    claude = anthropic.Anthropic(base_url=url, api_key="x", max_retries=0)  # x-api-key
    ask = {"model": "smollm2-135m", "max_tokens": 16, "messages": CHAT,
           "extra_body": {"temperature": 0}}  # the SDK's create() names no sampling field
    reply = claude.messages.create(**ask)
    out.append(reply.content[0].text)
    with claude.messages.stream(**ask) as stream:
        out.append("".join(stream.text_stream))
    assert claude.messages.count_tokens(model="smollm2-135m", messages=CHAT).input_tokens \
        == reply.usage.input_tokens + reply.usage.cache_read_input_tokens
    native = {"text": PROMPTS[2], "sampling_params": {"max_new_tokens": 16, "temperature": 0}}
    out.append(httpx.post(url + "/generate", json=native).json()["text"])  # SGLang's API
    with httpx.stream("POST", url + "/generate", json={**native, "stream": True}) as r:
        last = [ln for ln in r.iter_lines() if ln.startswith("data: {")][-1]
    out.append(json.loads(last[len("data: "):])["text"])
    # n > 1, seeded: a decode instance runs each sequence alone, seeded as a fork seeds them
    several = client.completions.create(model="smollm2-135m", prompt=PROMPTS[:2], n=3,
                                        max_tokens=8, temperature=1.0, seed=11)
    out += [c.text for c in sorted(several.choices, key=lambda c: c.index)]
    pair = httpx.post(url + "/generate", json={"text": PROMPTS[0], "sampling_params": {
        "n": 2, "max_new_tokens": 8, "temperature": 1.0, "sampling_seed": 5}}).json()
    out += [p["text"] for p in pair]
    return out


def ask_long_in_background(url: str, result: dict) -> threading.Thread:
    """One long-prompt request on a thread; its response or APIError lands in result."""
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)

    def ask() -> None:
        try:
            result["out"] = client.completions.create(model="smollm2-135m", prompt=LONG,
                                                      max_tokens=8)
        except openai.APIError as exc:
            result["out"] = exc
    t = threading.Thread(target=ask)
    t.start()
    return t


def test_greedy_through_1p1d_equals_a_mixed_engine():
    pd = Server("--pd", "1P1D", "--dtype", "float32")
    try:
        got = answers(pd.url)
        prefill, decode = instances(pd.url)
        assert httpx.get(prefill + "/health").json()["role"] == "prefill"
        wait_until(lambda: metric(prefill, "tidal:prompt_tokens_total") > 0)
        assert metric(decode, "tidal:prompt_tokens_total") == 0  # decode never prefilled
        # a prefill or decode instance refuses requests that skip the router
        direct = httpx.post(decode + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
        assert direct.status_code == 400 and "tidal router" in direct.json()["error"]["message"]
        assert httpx.get(pd.url + "/get_model_info").json()["model_path"] == "smollm2-135m"
        beams = httpx.post(pd.url + "/v1/completions",
                           json={"prompt": "Hi", "n": 2, "use_beam_search": True})
        assert beams.status_code == 400 and beams.json()["error"]["param"] == "use_beam_search"
    finally:
        pd.stop()
    mixed = Server("--dtype", "float32")
    try:
        assert answers(mixed.url) == got
        copied = copy_answer(mixed.url)
    finally:
        mixed.stop()
    spec = Server("--pd", "1P1D", "--dtype", "float32", "--speculative-method", "ngram",
                  "--pipeline-parallel-size", "2")
    try:  # both instances split into two stages, the decode one speculates: the same tokens
        assert answers(spec.url) == got and copy_answer(spec.url) == copied
        _, decode = instances(spec.url)
        assert metric(decode, "tidal:spec_decode_num_accepted_tokens_total") > 0
        # a predicted output (OpenAI's) reaches the speculating decode: its guesses land
        chat = openai.OpenAI(base_url=spec.url + "/v1", api_key="x", max_retries=0).chat
        ask = dict(model="smollm2-135m", max_tokens=24, temperature=0,
                   messages=[{"role": "user", "content": "Name three colours."}])
        answer = chat.completions.create(**ask).choices[0].message.content
        before = metric(decode, "tidal:spec_decode_num_accepted_tokens_total")
        again = chat.completions.create(**ask, prediction={"type": "content",
                                                           "content": answer})
        assert again.choices[0].message.content == answer
        wait_until(lambda: metric(decode, "tidal:spec_decode_num_accepted_tokens_total")
                   - before >= 0.5 * again.usage.completion_tokens)
    finally:
        spec.stop()


def other_answers(url: str) -> tuple[list[str], list[list[float]], list[float]]:
    """Responses (one, its continuation, a stream; retrieved and deleted), a chat through
    /invocations, embeddings, and rerank scores, through the official client where it has
    the call."""
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    ask = dict(model="smollm2-135m", max_output_tokens=12, temperature=0)
    first = client.responses.create(input="What is the capital of France?", **ask)
    then = client.responses.create(input="And of Italy?", previous_response_id=first.id, **ask)
    streamed = "".join(e.delta for e in client.responses.create(
        input="Name a colour.", stream=True, **ask) if e.type == "response.output_text.delta")
    assert client.responses.retrieve(first.id).output_text == first.output_text
    story = client.responses.create(input="Tell me a very long story about the sea.",
                                    background=True, model="smollm2-135m",
                                    max_output_tokens=500)
    assert client.responses.cancel(story.id).status == "cancelled"  # on its holder
    with httpx.stream("POST", url + "/generate", json={
            "text": "Tell me a story.", "rid": "story-1", "stream": True,
            "sampling_params": {"max_new_tokens": 2000, "ignore_eos": True}}) as r:
        lines = (ln for ln in r.iter_lines() if ln.startswith("data: {"))
        next(lines)  # it runs: SGLang's abort reaches the instance that holds it
        assert httpx.get(url + "/load").json() == {"server_load": 1}  # vLLM's: this one
        assert httpx.post(url + "/abort_request", json={"rid": "story-1"}).status_code == 200
        last = json.loads(list(lines)[-1][len("data: "):])
    assert last["meta_info"]["finish_reason"]["type"] == "abort"
    client.responses.delete(then.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(then.id)
    with pytest.raises(openai.NotFoundError) as gone:
        client.responses.create(input="More?", previous_response_id=then.id, **ask)
    assert gone.value.body["param"] == "previous_response_id"
    vectors = [d.embedding for d in client.embeddings.create(
        model="smollm2-135m", input=["the sea", "a mountain"]).data]
    encoded = httpx.post(url + "/encode", json={"text": "the sea"}).json()  # SGLang's
    assert encoded["embedding"] == pytest.approx(vectors[0], abs=1e-5)
    rerank = httpx.post(url + "/v1/rerank", json={
        "query": "Where is Paris?", "documents": ["Paris is in France.", "Cats purr."]}).json()
    scores = [r["relevance_score"] for r in sorted(rerank["results"], key=lambda r: r["index"])]
    # SageMaker's /invocations: each body where its own endpoint's goes
    ranked = httpx.post(url + "/invocations", json={
        "query": "Where is Paris?", "documents": ["Paris is in France.", "Cats purr."]}).json()
    assert ranked["results"] == rerank["results"]
    said = httpx.post(url + "/invocations", timeout=60, json={
        "messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 12,
        "temperature": 0}).json()["choices"][0]["message"]["content"]
    assert httpx.get(url + "/ping").status_code == 200
    return [first.output_text, then.output_text, streamed, said], vectors, scores


def test_responses_embeddings_and_scores_through_the_router_equal_a_mixed_engine():
    """Over two decode instances a continuation, a retrieval and a deletion find the one
    that stored the response; embeddings and scores are computed by the prefill instance
    (a decode one refuses them)."""
    flags = ("--dtype", "float32", "--score-tokens", "no,yes")
    pd = Server("--pd", "1P2D", *flags)
    try:
        prefill, decode = instances(pd.url)
        prompts = metric(prefill, "tidal:prompt_tokens_total")
        texts, vectors, scores = other_answers(pd.url)
        assert metric(prefill, "tidal:prompt_tokens_total") > prompts
        assert metric(decode, "tidal:prompt_tokens_total") == 0
        direct = httpx.post(decode + "/v1/embeddings", json={"input": "the sea"})
        assert direct.status_code == 400 and "prefill" in direct.json()["error"]["message"]
        # two at once land on both decode instances; each continuation finds its own
        client = openai.OpenAI(base_url=pd.url + "/v1", api_key="x", max_retries=0)
        ask = dict(model="smollm2-135m", max_output_tokens=12, temperature=0)
        with ThreadPoolExecutor(2) as pool:
            pair = list(pool.map(lambda q: client.responses.create(input=q, **ask),
                                 ["Hi!", "Hello!"]))
        decodes = httpx.get(pd.url + "/health").json()["decode"]
        holders = [[httpx.get(f"{d}/v1/responses/{r.id}").status_code == 200 for d in decodes]
                   for r in pair]
        assert sorted(holders) == [[False, True], [True, False]]
        for r in pair:
            client.responses.create(input="Go on.", previous_response_id=r.id, **ask)
        with pytest.raises(openai.NotFoundError, match="does not serve the Batch API"):
            client.batches.list()
        # a pause reaches every instance; a request sent meanwhile waits for the resume
        assert httpx.get(pd.url + "/health_generate", timeout=60).status_code == 200
        assert httpx.post(pd.url + "/pause", params={"mode": "keep"}).status_code == 200
        for inst in (prefill, *decodes):
            assert httpx.get(inst + "/is_paused").json() == {"is_paused": True}
        assert httpx.get(pd.url + "/health_generate", timeout=5).status_code == 200
        with ThreadPoolExecutor(1) as pool:
            late = pool.submit(client.responses.create, input="Hi!", **ask)
            time.sleep(1.0)
            assert not late.done()
            assert httpx.post(pd.url + "/continue_generation").status_code == 200
            assert late.result(timeout=60).output_text == pair[0].output_text
        assert httpx.get(pd.url + "/is_paused").json() == {"is_paused": False}
    finally:
        pd.stop()
    mixed = Server(*flags)
    try:
        want_texts, want_vectors, want_scores = other_answers(mixed.url)
    finally:
        mixed.stop()
    assert texts == want_texts and all(texts)
    for got, want in zip(vectors, want_vectors):
        assert got == pytest.approx(want, abs=1e-5)
    assert scores == pytest.approx(want_scores, abs=1e-5)


def copy_answer(url: str) -> str:
    """A completion that repeats its prompt's text: n-gram guesses are accepted."""
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    text = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu"
    return client.completions.create(model="smollm2-135m", prompt=f"{text}\n{text}\n{text}\n",
                                     max_tokens=32, temperature=0).choices[0].text


def test_the_router_refuses_a_bad_request_with_the_servers_own_error():
    """The router parses bodies with the server's models and answers with its error
    handlers: a bad request gets the decode instance's very 400 (or 401) body."""
    key = "pd-key"
    pd = Server("--pd", "1P1D", "--api-key", key)
    try:
        _, decode = instances(pd.url)
        auth = {"authorization": f"Bearer {key}"}
        for path, body in BAD:
            via_router = httpx.post(pd.url + path, json=body, headers=auth, timeout=60)
            direct = httpx.post(decode + path, json=body, headers=auth, timeout=60)
            assert via_router.status_code == direct.status_code == 400, (path, body)
            assert via_router.json() == direct.json(), (path, body)
        for body in ({"messages": [], "max_tokens": 4},  # Anthropic's shape, its key header
                     {"messages": [{"role": "system", "content": "hi"}], "max_tokens": 4},
                     {"messages": [{"role": "user", "content": "hi"}], "top_k": -1}):
            via_router = httpx.post(pd.url + "/v1/messages", json=body,
                                    headers={"x-api-key": key})
            direct = httpx.post(decode + "/v1/messages", json=body, headers={"x-api-key": key})
            assert via_router.status_code == direct.status_code == 400, body
            assert via_router.json() == direct.json() and direct.json()["type"] == "error"
        raw_headers = {**auth, "content-type": "application/json"}
        for raw in (b"{not json", b'{"prompt": "\xff\xfe"}', b"[1, 2]",
                    b'{"prompt": "hi", "n": 0}'):
            via_router = httpx.post(pd.url + "/v1/completions", content=raw,
                                    headers=raw_headers)
            direct = httpx.post(decode + "/v1/completions", content=raw, headers=raw_headers)
            assert via_router.status_code == direct.status_code == 400, raw
            assert via_router.json() == direct.json(), raw
        for headers in ({}, {"authorization": "Bearer nope"}):  # the key before the body
            via_router = httpx.post(pd.url + "/v1/completions", json={"prompt": ""},
                                    headers=headers)
            direct = httpx.post(decode + "/v1/completions", json={"prompt": ""},
                                headers=headers)
            assert via_router.status_code == direct.status_code == 401
            assert via_router.json() == direct.json()
        missing = httpx.get(pd.url + "/v1/nowhere", headers=auth)
        assert missing.status_code == 404
        assert missing.json() == httpx.get(decode + "/v1/nowhere", headers=auth).json()
        check_router_dashboard(pd.url, key)
        for path, body in (("/tokenize", {"prompt": "Hello there"}),
                           ("/tokenize", {"messages": [{"role": "user", "content": "Hi"}]}),
                           ("/detokenize", {"tokens": [19556, 665]}),
                           ("/detokenize", {"tokens": [-1]})):  # a 400 naming tokens
            via_router = httpx.post(pd.url + path, json=body, headers=auth)
            direct = httpx.post(decode + path, json=body, headers=auth)
            assert via_router.status_code == direct.status_code, (path, body)
            assert via_router.json() == direct.json(), (path, body)
        assert httpx.post(pd.url + "/tokenize", json={"prompt": "x"}).status_code == 401
        for name, status in (("smollm2-135m", 200), ("org/other", 404)):  # OpenAI's retrieve
            via_router = httpx.get(pd.url + f"/v1/models/{name}", headers=auth)
            direct = httpx.get(decode + f"/v1/models/{name}", headers=auth)
            assert via_router.status_code == direct.status_code == status, name
            assert via_router.json()["error" if status == 404 else "id"] == \
                direct.json()["error" if status == 404 else "id"]
        assert httpx.post(pd.url + "/reset_prefix_cache").status_code == 401
        assert httpx.post(pd.url + "/reset_prefix_cache", headers=auth).status_code == 200
    finally:
        log = pd.stop()
    assert log.count("prefix cache reset") == 2  # the prefill and the decode instance


def check_router_dashboard(url: str, key: str) -> None:
    """The router's dashboard needs the key and merges both instances' streams: a panel
    (core id, label) per instance core, prefill first."""
    assert httpx.get(url + "/dashboard").status_code == 401
    assert httpx.get(url + "/dashboard/stream").status_code == 401
    assert "EventSource" in httpx.get(url + f"/dashboard?api_key={key}").text
    sent = threading.Thread(target=lambda: httpx.post(
        url + "/v1/completions", json={"prompt": "hi there", "max_tokens": 8},
        headers={"authorization": f"Bearer {key}"}, timeout=60))
    sent.start()
    seen = {}
    with httpx.stream("GET", url + f"/dashboard/stream?api_key={key}", timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                event = json.loads(line[len("data: "):])
                seen[event["core"]] = event["label"]
                if len(seen) == 2:
                    break
    sent.join()
    assert sorted(seen) == [0, 1000]
    assert seen[0].startswith("prefill http://") and seen[1000].startswith("decode http://")


def test_a_dead_prefill_core_fails_its_request_and_the_decode_side_frees_the_blocks():
    pd = Server("--pd", "1P1D")
    try:
        prefill, decode = instances(pd.url)
        result: dict[str, object] = {}
        t = ask_long_in_background(pd.url, result)
        wait_until(lambda: used_blocks(decode) > 0)  # blocks allocated, prefill under way
        os.kill(core_pid(prefill), signal.SIGKILL)
        t.join(60)
        assert isinstance(result["out"], openai.APIError)
        assert "prefill instance" in str(result["out"])
        wait_until(lambda: used_blocks(decode) == 0)
    finally:
        pd.stop()


def test_a_dead_decode_core_fails_its_request_and_the_prefill_side_frees_the_blocks():
    pd = Server("--pd", "1P1D", "--max-input-tokens-per-step", "256", "--restart-core", "0")
    try:
        prefill, decode = instances(pd.url)
        assert used_blocks(prefill) == 0  # the gauges are there from the first scrape on
        result: dict[str, object] = {}
        t = ask_long_in_background(pd.url, result)
        wait_until(lambda: used_blocks(prefill) > 0)  # prefilling in chunks of 256
        os.kill(core_pid(decode), signal.SIGKILL)
        t.join(60)
        assert isinstance(result["out"], openai.APIStatusError)
        assert result["out"].status_code == 503
        wait_until(lambda: used_blocks(prefill) == 0)
        assert httpx.get(pd.url + "/health").status_code == 503  # the router says who is down
    finally:
        pd.stop()
