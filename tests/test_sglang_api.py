"""SGLang's native API (tidal/server/sglang/): a /generate body's translation into a
completions request (SGLang's sampling names, logprob fields, refusals naming SGLang's
fields), the answer's shape (finish_reason objects, ids, logprob triples, lists for batches
and n), /health_generate's probe (shared, timed out, busy), and end to end on a keyed server:
/generate agrees token for token with /v1/completions (whole, streamed, batched, with
logprobs of output and prompt), /abort_request ends requests answered with what they have,
/get_model_info, /get_server_info without the key; the server started by SGLang's
launch_server words."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import time
from types import SimpleNamespace

import httpx
import pytest

from server_fixtures import Server, metric
from tidal.core import PromptLogprob, TokenLogprob
from tidal.engine.outputs import StepUpdate
from tidal.server.openai.protocol import APIError
from tidal.server.sglang import routes
from tidal.server.sglang.output import GenerateBody
from tidal.server.sglang.request import GenerateRequest

KEY = "sglang-test-key"
AUTH = {"authorization": f"Bearer {KEY}"}
PROMPT = "The capital of France is"


# ---------------------------------------------------------------------- translation

def completion(**body):
    return GenerateRequest.model_validate(body).completion_request()


def test_sampling_params_take_sglangs_names():
    c = completion(text=PROMPT, sampling_params={
        "max_new_tokens": 7, "min_new_tokens": 2, "no_stop_trim": True, "sampling_seed": 5,
        "stop": ["x"], "top_k": -1, "temperature": 0, "regex": "[0-9]+"})
    assert (c.max_tokens, c.min_tokens, c.include_stop_str_in_output, c.seed, c.stop,
            c.top_k, c.temperature) == (7, 2, True, 5, ["x"], -1, 0)
    assert c.output_constraint() == ("guided_regex", ("regex", "[0-9]+"))
    assert completion(text=PROMPT).output_limit() is None  # the default: 128 (below)
    assert type(completion(text=PROMPT)).default_max_tokens == 128
    zero = completion(input_ids=[1, 2], sampling_params={"max_new_tokens": 0})
    assert zero.prompt_only and zero.output_limit() == 1 and zero.prompt == [1, 2]


def test_logprob_fields_become_output_and_prompt_logprobs():
    c = completion(text=PROMPT, return_logprob=True, top_logprobs_num=3)
    assert (c.num_logprobs(), c.prompt_logprob_count()) == (3, None)
    c = completion(text=PROMPT, return_logprob=True, logprob_start_len=0)
    assert (c.num_logprobs(), c.prompt_logprob_count()) == (0, 0)
    assert completion(text=PROMPT, top_logprobs_num=3).num_logprobs() is None


@pytest.mark.parametrize("body, param", [
    ({"text": "a", "input_ids": [1]}, "text"),
    ({}, "text"),
    ({"text": "a", "sampling_params": {"max_tokens": 3}}, "sampling_params.max_tokens"),
    ({"text": "a", "sampling_params": {"temperature": 3}}, "sampling_params.temperature"),
    ({"text": "a", "sampling_params": {"min_new_tokens": -1}},
     "sampling_params.min_new_tokens"),
    ({"text": "a", "sampling_params": {"no_stop_trim": "yes"}}, "sampling_params.no_stop_trim"),
    ({"text": "a", "sampling_params": {"json_schema": "{not json"}},
     "sampling_params.json_schema"),
    ({"text": "a", "sampling_params": {"regex": "a", "ebnf": "root ::= 'a'"}},
     "sampling_params.ebnf"),
    ({"text": "a", "sampling_params": {"custom_params": {"x": 1}}},
     "sampling_params.custom_params"),
    ({"text": "a", "image_data": "cat.png"}, "image_data"),
    ({"text": "a", "return_hidden_states": True}, "return_hidden_states"),
    ({"text": ["a", "b"], "rid": "one"}, "rid"),
    ({"text": ["a", "b"], "rid": ["x", "x"]}, "rid"),
    ({"text": ["a", "b"], "sampling_params": [{"n": 1}]}, "sampling_params"),
    ({"text": ["a", "b"], "sampling_params": [{"temperature": 0}, {"temperature": 1}]},
     "sampling_params"),
    ({"text": "a", "unknown": 1}, "unknown"),
])
def test_a_bad_body_is_a_400_naming_sglangs_field(body, param):
    with pytest.raises(Exception) as exc:
        completion(**body)
    err = exc.value
    if not isinstance(err, APIError):  # pydantic's, as the server's handler reads it
        first = err.errors()[0]
        err = APIError(first["msg"], param=first["ctx"]["param"] if first["type"] == "refused"
                       else ".".join(map(str, first["loc"])))
    assert err.param == param, err.message
    word = param.rsplit(".", 1)[-1]
    assert word in err.message or param in ("text", "sampling_params", "rid", "unknown")


def test_names_in_a_renamed_message_are_whole_words():
    with pytest.raises(APIError) as exc:  # guided_json's check, named as SGLang's field
        completion(text="a", sampling_params={"json_schema": "[]"})
    assert exc.value.message.startswith("json_schema") and "guided" not in exc.value.message
    from tidal.server.sglang.request import in_sglang_terms

    said = in_sglang_terms(APIError("logprobs must be at most 20 (--max-logprobs)",
                                    param="logprobs"))
    assert said.message == "top_logprobs_num must be at most 20 (--max-logprobs)"


# ---------------------------------------------------------------------- the answer's shape

class Tok:
    def decode(self, ids, skip_special_tokens=False):
        return "".join(f"<{i}>" for i in ids)


def update(rid, tokens, text, finished=False, reason=None, index=0, stop=None, lps=None,
           prompt_lps=None, cached=0):
    return StepUpdate(rid, rid, index, tokens, text, finished, reason, logprobs=lps,
                      prompt_logprobs=prompt_lps, stop_string=stop, cached_tokens=cached)


def run_body(updates, prompts, n=1, **kw):
    body = GenerateBody(Tok(), "m", "abc-0", prompts, len(prompts) * n, kw.pop("lp", False),
                        prompt_logprobs=kw.pop("plp", False), **kw)

    async def gen():
        for item in updates:
            yield item
    return json.loads(asyncio.run(body.body(gen())).body)


def test_finish_reasons_say_what_ended_the_sequence():
    out = run_body([(0, update("abc-0", [5, 2], "hi", True, "stop", cached=16)),
                    (1, update("abc-1", [7], "x", True, "stop", stop="END")),
                    (2, update("abc-2", [1, 1, 1], "aaa", True, "length"))],
                   [[1] * 20, [2], [3, 3]], batch=True)
    assert [o["meta_info"]["finish_reason"] for o in out] == [
        {"type": "stop", "matched": 2}, {"type": "stop", "matched": "END"},
        {"type": "length", "length": 3}]
    assert [o["index"] for o in out] == [0, 1, 2]
    assert [o["meta_info"]["id"] for o in out] == ["abc-0", "abc-1", "abc-2"]
    first = out[0]
    assert (first["text"], first["output_ids"]) == ("hi", [5, 2])
    meta = first["meta_info"]
    assert (meta["prompt_tokens"], meta["completion_tokens"], meta["cached_tokens"]) == \
        (20, 2, 16)
    assert meta["e2e_latency"] >= 0


def test_one_prompt_is_one_object_n_is_a_list_named_by_the_rids():
    one = run_body([(0, update("abc-0", [4], "a", True, "length"))], [[1]])
    assert isinstance(one, dict) and "index" not in one
    two = run_body([(0, update("abc-0", [4], "a", True, "length")),
                    (1, update("abc-0-1", [5], "b", True, "length", index=1))], [[1]], n=2,
                   rids=["mine"])
    assert [o["meta_info"]["id"] for o in two] == ["mine-0", "mine-1"]


def test_logprobs_are_triples_with_text_when_asked():
    lps = [TokenLogprob(-0.5, [(4, -0.5), (9, -1.5)])]
    prompt = [None, PromptLogprob(-2.0, [(3, -1.0)], 2), PromptLogprob(-0.1, [(8, -0.1)], 1)]
    out = run_body([(0, update("abc-0", [4], "a", True, "length", lps=lps,
                               prompt_lps=prompt))], [[6, 7, 8]], lp=True, plp=True, start=1,
                   top=1, text_in_logprobs=True)
    meta = out["meta_info"]
    assert meta["output_token_logprobs"] == [[-0.5, 4, "<4>"]]
    assert meta["output_top_logprobs"] == [[[-0.5, 4, "<4>"], [-1.5, 9, "<9>"]]]
    assert meta["input_token_logprobs"] == [[-2.0, 7, "<7>"], [-0.1, 8, "<8>"]]
    assert meta["input_top_logprobs"] == [[[-1.0, 3, "<3>"]], [[-0.1, 8, "<8>"]]]
    plain = run_body([(0, update("abc-0", [4], "a", True, "length", lps=lps,
                                 prompt_lps=prompt))], [[6, 7, 8]], lp=True, plp=True, start=0)
    assert plain["meta_info"]["input_token_logprobs"][0] == [None, 6, None]
    assert "output_top_logprobs" not in plain["meta_info"]


# ---------------------------------------------------------------------- /health_generate

class FakeClient:
    """Records the probe's requests; `answer` says what its queue gets."""

    def __init__(self, answer: str) -> None:
        self.answer, self.added, self.aborted, self.released = answer, [], [], []
        self.last_output, self.holds = 0.0, set()
        self.config = SimpleNamespace(scheduler=SimpleNamespace(role="mixed"))

    async def add(self, rid, ids, params, queue, prefill=None):
        self.added.append((rid, ids, params.max_tokens))
        if self.answer == "token":
            asyncio.get_running_loop().call_later(
                0.05, queue.put_nowait, update(rid, [3], "x", True, "length"))
        elif self.answer == "busy":  # others' tokens come, the probe's does not
            asyncio.get_running_loop().call_later(0.05, self.bump)
        return queue

    def bump(self) -> None:
        import time
        self.last_output = time.monotonic()

    async def abort(self, rid):
        self.aborted.append(rid)

    def release(self, rid):
        self.released.append(rid)


def frontend(answer: str):
    return SimpleNamespace(client=FakeClient(answer), health_probe=None,
                           config=SimpleNamespace(health_generate_timeout=0.3))


def test_health_generate_is_one_token_shared_by_callers_at_once():
    f = frontend("token")

    async def three():
        return await asyncio.gather(*(routes.health_generate(f) for _ in range(3)))
    answers = asyncio.run(three())
    assert [a.status_code for a in answers] == [200] * 3
    assert len(f.client.added) == 1 and f.client.added[0][1:] == ([0], 1)
    assert f.client.released == [f.client.added[0][0]] and not f.client.aborted
    asyncio.run(routes.health_generate(f))  # a later call probes anew
    assert len(f.client.added) == 2


def test_health_generate_is_503_when_no_token_comes_and_200_when_the_engine_is_busy():
    f = frontend("nothing")
    with pytest.raises(APIError) as exc:
        asyncio.run(routes.health_generate(f))
    assert exc.value.status == 503 and "no token within" in exc.value.message
    assert f.client.aborted == [f.client.added[0][0]]  # the probe does not linger
    busy = frontend("busy")
    assert asyncio.run(routes.health_generate(busy)).status_code == 200
    f.client.config.scheduler.role = "decode"
    with pytest.raises(APIError) as exc:
        asyncio.run(routes.health_generate(f))
    assert exc.value.status == 400 and "tidal router" in exc.value.message


# ---------------------------------------------------------------------- end to end

@pytest.fixture(scope="module")
def server():
    s = Server("--api-key", KEY, "--dtype", "float32", "--model-path", "smollm2-135m",
               "--context-length", "4096", "--max-running-requests", "32",
               "--schedule-policy", "lpm", "--enable-metrics",  # SGLang's own words
               "--log-level", "warning", "--log-level-http", "warning")
    yield s
    s.stop()


def test_log_levels_quiet_the_server_its_engine_core_and_uvicorn(server):
    """--log-level: tidal's own lines, the engine core's too; --log-level-http: uvicorn's."""
    assert post(server, "/generate", {"text": "Hi", "sampling_params": {
        "max_new_tokens": 2}}).status_code == 200
    out = server.output()
    assert "engine core ready" not in out and "model loaded" not in out  # frontend, core
    assert "Uvicorn running" not in out and "HTTP/1.1" not in out  # uvicorn's, access lines


def post(server, path, body, **kw):
    return httpx.post(server.url + path, json=body, headers=AUTH, timeout=120, **kw)


def complete(server, **body):
    r = post(server, "/v1/completions", {"temperature": 0, **body})
    assert r.status_code == 200, r.text
    return r.json()


def generate(server, **body):
    r = post(server, "/generate", body)
    assert r.status_code == 200, r.text
    return r.json()


def test_generate_answers_as_completions_do(server):
    greedy = {"temperature": 0, "max_new_tokens": 12}
    ref = complete(server, prompt=PROMPT, max_tokens=12, return_token_ids=True)["choices"][0]
    one = generate(server, text=PROMPT, sampling_params=greedy)
    assert (one["text"], one["output_ids"]) == (ref["text"], ref["token_ids"])
    assert one["meta_info"]["finish_reason"] == {"type": "length", "length": 12}
    ids = httpx.post(server.url + "/tokenize", json={"prompt": PROMPT}, headers=AUTH).json()
    batch = generate(server, input_ids=[ids["tokens"], ids["tokens"][:3]], rid=["a", "b"],
                     sampling_params=[greedy, greedy])
    assert [b["meta_info"]["id"] for b in batch] == ["a", "b"]
    assert batch[0]["text"] == ref["text"]
    assert batch[0]["meta_info"]["prompt_tokens"] == ids["count"]
    short = complete(server, prompt=ids["tokens"][:3], max_tokens=12)["choices"][0]["text"]
    assert batch[1]["text"] == short
    stop = ref["text"].split()[1]  # a word of the answer ends it, as a stop string
    cut = generate(server, text=PROMPT, sampling_params={**greedy, "stop": [stop]})
    assert cut["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert stop not in cut["text"] and ref["text"].startswith(cut["text"])
    kept = generate(server, text=PROMPT, sampling_params={**greedy, "stop": [stop],
                                                          "no_stop_trim": True})
    assert kept["text"] == cut["text"] + stop


def test_a_stream_sends_each_sequence_so_far_then_done(server):
    body = {"text": PROMPT, "sampling_params": {"temperature": 0, "max_new_tokens": 10}}
    whole = generate(server, **body)
    with httpx.stream("POST", server.url + "/generate", json={**body, "stream": True},
                      headers=AUTH, timeout=120) as r:
        lines = [ln for ln in r.iter_lines() if ln.startswith("data:")]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(ln[5:]) for ln in lines[:-1]]
    assert len(chunks) >= 2
    texts = [c["text"] for c in chunks]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))  # cumulative
    assert [c["meta_info"]["finish_reason"] for c in chunks[:-1]] == [None] * (len(chunks) - 1)
    last = chunks[-1]
    assert (last["text"], last["output_ids"]) == (whole["text"], whole["output_ids"])
    assert last["meta_info"]["finish_reason"] == whole["meta_info"]["finish_reason"]


def test_logprobs_agree_with_completions(server):
    ref = complete(server, prompt=PROMPT, max_tokens=6, logprobs=2, prompt_logprobs=1)
    out = generate(server, text=PROMPT, return_logprob=True, top_logprobs_num=2,
                   logprob_start_len=0, sampling_params={"temperature": 0, "max_new_tokens": 6})
    meta = out["meta_info"]
    choice = ref["choices"][0]
    assert [e[0] for e in meta["output_token_logprobs"]] == pytest.approx(
        choice["logprobs"]["token_logprobs"], abs=1e-5)
    assert [len(t) for t in meta["output_top_logprobs"]] == [2] * 6
    vllm = choice["prompt_logprobs"]
    assert meta["input_token_logprobs"][0][0] is None and vllm[0] is None
    for (lp, t, _), entry in zip(meta["input_token_logprobs"][1:], vllm[1:]):
        assert lp == pytest.approx(entry[str(t)]["logprob"], abs=1e-5)
    alone = generate(server, text=PROMPT, return_logprob=True, logprob_start_len=2,
                     sampling_params={"max_new_tokens": 0})
    assert (alone["text"], alone["output_ids"]) == ("", [])
    assert alone["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    assert [e[1] for e in alone["meta_info"]["input_token_logprobs"]] == \
        [t for _, t, _ in meta["input_token_logprobs"][2:]]


def test_a_repeated_prompt_reports_its_cached_tokens(server):
    text = "Tell me about the sea and the ships that sail on it. " * 4  # > one block
    params = {"temperature": 0, "max_new_tokens": 2}
    generate(server, text=text, sampling_params=params)
    again = generate(server, text=text, sampling_params=params)
    assert again["meta_info"]["cached_tokens"] >= 16


def test_refusals_over_http_and_the_key(server):
    r = post(server, "/generate", {"text": "a", "sampling_params": {"max_new_tokens": 10**6}})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "sampling_params.max_new_tokens" and "max_new_tokens" in \
        err["message"]
    r = post(server, "/generate", {"text": "a", "return_logprob": True, "top_logprobs_num": 50})
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs_num"
    assert "top_logprobs_num must be at most 20" in r.json()["error"]["message"]
    r = post(server, "/generate", {"text": "a", "lora_path": "nope"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert httpx.post(server.url + "/generate", json={"text": "a"}).status_code == 401
    for path in ("/get_model_info", "/get_server_info"):
        assert httpx.get(server.url + path).status_code == 401
    assert httpx.get(server.url + "/health_generate", timeout=60).status_code == 200
    off = post(server, "/start_profile", {})  # no --profiler-dir
    assert off.status_code == 400 and "--profiler-dir" in off.json()["error"]["message"]


def test_model_and_server_info(server):
    info = httpx.get(server.url + "/get_model_info", headers=AUTH).json()
    assert info["model_path"] == "smollm2-135m" and info["is_generation"] is True
    r = httpx.get(server.url + "/get_server_info", headers=AUTH)
    assert KEY not in r.text and "api_key" not in r.json()["server"]
    got = r.json()
    assert got["max_total_num_tokens"] == 256 * got["page_size"]
    assert got["dp_size"] == 1 and got["engine"]["model"]["dtype"] == "float32"
    assert (got["context_length"], got["max_running_requests"]) == (4096, 32)  # as launched
    assert got["engine"]["scheduler"]["policy"] == "longest_prefix_match"


def test_encode_answers_the_embeddings_of_v1_embeddings(server):
    texts = ["the sea", "a mountain"]
    ref = post(server, "/v1/embeddings", {"input": texts}).json()["data"]
    one = post(server, "/encode", {"text": texts[0], "rid": "e1"}).json()
    assert one["meta_info"]["id"] == "e1" and one["meta_info"]["prompt_tokens"] == 2
    assert one["embedding"] == pytest.approx(ref[0]["embedding"], abs=1e-5)
    ids = httpx.post(server.url + "/tokenize", json={"prompt": texts[1]}, headers=AUTH).json()
    batch = post(server, "/encode", {"input_ids": [ids["tokens"]]}).json()
    assert isinstance(batch, list) and len(batch) == 1
    assert batch[0]["embedding"] == pytest.approx(ref[1]["embedding"], abs=1e-5)
    bad = post(server, "/encode", {"input_ids": [10**7]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "input_ids"
    assert post(server, "/encode", {"text": "a", "dimensions": 10**6}).json()["error"][
        "param"] == "dimensions"


def test_abort_request_ends_a_request_with_what_it_generated(server):
    """/abort_request by a /generate rid ends that stream at once with the greedy tokens so
    far and finish_reason abort; by a completion's request_id (or abort_all) a whole body
    answers the same way; the blocks come back; a name nothing has is no error."""
    long = {"temperature": 0, "max_new_tokens": 3000, "ignore_eos": True}
    with httpx.stream("POST", server.url + "/generate", headers=AUTH, timeout=120,
                      json={"text": PROMPT, "rid": "roll-1", "sampling_params": long,
                            "stream": True}) as r:
        lines = r.iter_lines()
        first = next(ln for ln in lines if ln.startswith("data:"))
        assert json.loads(first[5:])["meta_info"]["finish_reason"] is None
        assert post(server, "/abort_request", {"rid": "roll-1", "abort_message": "enough"}
                    ).status_code == 200
        rest = [ln for ln in lines if ln.startswith("data:")]
    assert rest[-1] == "data: [DONE]"
    last = json.loads(rest[-2][5:])
    assert last["meta_info"]["finish_reason"] == {"type": "abort", "message": "enough"}
    got = last["output_ids"]
    assert 0 < len(got) < 3000 and last["meta_info"]["completion_tokens"] == len(got)
    ref = complete(server, prompt=PROMPT, max_tokens=len(got), ignore_eos=True,
                   return_token_ids=True)["choices"][0]
    assert (got, last["text"]) == (ref["token_ids"], ref["text"])

    for abort in ({"rid": "mine"}, {"abort_all": True}):
        made = metric(server.url, "tidal:generation_tokens_total")
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            answer = pool.submit(post, server, "/v1/completions", {
                "prompt": PROMPT, "max_tokens": 3000, "ignore_eos": True, "temperature": 0,
                "request_id": "mine"})
            deadline = time.monotonic() + 60
            while metric(server.url, "tidal:generation_tokens_total") < made + 4 and \
                    time.monotonic() < deadline:  # a few tokens made
                time.sleep(0.05)
            assert post(server, "/abort_request", abort).status_code == 200
            choice = answer.result(timeout=60).json()["choices"][0]
        assert choice["finish_reason"] == "abort" and 0 < len(choice["text"])
        assert ref["text"].startswith(choice["text"]) or choice["text"].startswith(ref["text"])
    deadline = time.monotonic() + 30  # the stats come with the core's next report
    while metric(server.url, "tidal:kv_cache_used_blocks") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert metric(server.url, "tidal:num_requests_running") == 0
    assert metric(server.url, "tidal:kv_cache_used_blocks") == 0
    assert post(server, "/abort_request", {"rid": "nobody"}).status_code == 200
    r = post(server, "/abort_request", {})
    assert r.status_code == 400 and r.json()["error"]["param"] == "rid"
    assert httpx.post(server.url + "/abort_request", json={"abort_all": True}
                      ).status_code == 401
