"""Pausing generation (tidal/server/pausing.py): an engine core paused in place plans no
step, completes the one in flight, and after the resume answers with the tokens of a run
never paused; end to end on a keyed server, vLLM's /pause in each mode (`keep` freezes a
stream and a new request until /resume, `abort` answers what was made, `wait` answers once
the requests in flight finished, `clear_cache`), /is_paused, SGLang's /pause_generation and
/continue_generation, /health_generate while paused, the refusals, a held request aborted
by name or left by its client (never computed), and a request a pause holds refused when
the server stops."""

from __future__ import annotations

import concurrent.futures
import json
import signal
import time

import httpx
import pytest

from server_fixtures import Server, metric
from tidal.core import SamplingParams
from tidal.core.invariants import check_invariants
from tidal.engine.config import EngineConfig
from tidal.engine.core import EngineCore

from model_fixtures import small_folder

KEY = "pause-key"
AUTH = {"authorization": f"Bearer {KEY}"}
PROMPT = "The capital of France is"
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


# ---------------------------------------------------------------------- the engine core

@pytest.fixture()
def folder(tmp_path, monkeypatch):
    monkeypatch.setenv("TIDAL_CACHE", str(tmp_path / "cache"))
    return small_folder(tmp_path, "tiny", "llama", max_position_embeddings=300)


def run(folder, async_scheduling: bool, pause: bool):
    """Two greedy requests on an engine core and a third after three steps, which (with
    `pause`) arrives while the core is paused: the tokens, and what the paused core did
    (whether it made no token, whether it holds work, the newest waiting request)."""
    core = EngineCore(EngineConfig.from_kwargs(
        model=str(folder), num_kv_blocks=100, num_threads=1, chunked_prefill_size=16,
        async_scheduling=async_scheduling), folder)
    for i in range(2):
        core.add(f"r{i}", list(range(3 + i, 30 + i)), GREEDY)
    tokens: dict[str, list[int]] = {}

    def take(outputs) -> None:
        for o in outputs:
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)

    steps, held = 0, None
    while core.has_work() or steps <= 3:
        if steps == 3 and pause:
            core.pause()
            while core.can_step():  # the step in flight completes
                take(core.step())
            before = {rid: list(t) for rid, t in tokens.items()}
            core.add("late", list(range(40, 60)), GREEDY)
            for _ in range(5):  # a core loop's passes: it never steps
                assert not core.can_step()
                take(core.step())
            held = (before == tokens, core.has_work(), core.scheduler.waiting[-1].request_id)
            core.resume()
        elif steps == 3:
            core.add("late", list(range(40, 60)), GREEDY)
        take(core.step())
        steps += 1
        check_invariants(core.scheduler)
    core.close()
    return tokens, held


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_core_paused_in_place_goes_on_as_if_never_paused(folder, async_scheduling):
    ref, _ = run(folder, async_scheduling, False)
    got, held = run(folder, async_scheduling, True)
    assert held == (True, True, "late")  # no token while paused; the new request waits
    assert got == ref and all(len(t) == 12 for t in got.values())


# ---------------------------------------------------------------------- end to end

@pytest.fixture(scope="module")
def server():
    s = Server("--api-key", KEY, "--dtype", "float32")
    yield s
    s.stop()


def post(server, path, body=None, **kw):
    return httpx.post(server.url + path, json=body, headers=AUTH, timeout=120, **kw)


def complete(server, **body):
    r = post(server, "/v1/completions", {"prompt": PROMPT, "temperature": 0, **body})
    assert r.status_code == 200, r.text
    return r.json()


def made(server) -> float:
    return metric(server.url, "tidal:generation_tokens_total")


def wait_for_tokens(server, at_least: float) -> None:
    deadline = time.monotonic() + 60
    while made(server) < at_least and time.monotonic() < deadline:
        time.sleep(0.05)


def is_paused(server) -> bool:
    return httpx.get(server.url + "/is_paused", headers=AUTH).json()["is_paused"]


def test_keep_freezes_requests_until_resume(server):
    """A stream frozen mid-way and a request sent while paused both go on at /resume: the
    stream with the greedy tokens of a run never paused; nothing is made meanwhile, and
    /health_generate stays 200."""
    ref = complete(server, max_tokens=60, ignore_eos=True)
    body = {"prompt": PROMPT, "max_tokens": 60, "ignore_eos": True, "temperature": 0,
            "stream": True}
    with concurrent.futures.ThreadPoolExecutor(1) as pool, \
            httpx.stream("POST", server.url + "/v1/completions", json=body, headers=AUTH,
                         timeout=120) as r:
        lines = (ln for ln in r.iter_lines() if ln.startswith("data:"))
        chunks = [next(lines)]
        assert post(server, "/pause", params={"mode": "keep", "clear_cache": "false"}
                    ).json() == {"status": "paused"}
        assert is_paused(server)
        late = pool.submit(complete, server, max_tokens=3)
        time.sleep(0.7)  # the core's next stats report: what it made up to the pause
        frozen = made(server)
        time.sleep(1.0)
        assert made(server) == frozen and not late.done()
        assert httpx.get(server.url + "/health_generate", timeout=5).status_code == 200
        never = post(server, "/pause", params={"mode": "wait"})  # what it holds cannot finish
        assert never.status_code == 400 and never.json()["error"]["param"] == "mode"
        assert post(server, "/resume").json() == {"status": "resumed"}
        chunks += [ln for ln in lines if ln != "data: [DONE]"]
        assert late.result(timeout=60)["choices"][0]["finish_reason"] == "length"
    assert not is_paused(server)
    chunks = [json.loads(ln[5:])["choices"][0] for ln in chunks]
    assert "".join(c["text"] for c in chunks) == ref["choices"][0]["text"]
    assert chunks[-1]["finish_reason"] == "length"


def test_abort_answers_what_was_made_and_holds_new_requests(server):
    """SGLang's /pause_generation (abort, its default) ends a completion in flight with what
    it made; a request sent while paused waits for /continue_generation."""
    ref = complete(server, max_tokens=40, ignore_eos=True)["choices"][0]["text"]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        start = made(server)
        long = pool.submit(complete, server, max_tokens=3000, ignore_eos=True)
        wait_for_tokens(server, start + 4)
        r = post(server, "/pause_generation", {})
        assert r.json() == {"message": "Generation paused successfully.", "status": "ok"}
        choice = long.result(timeout=60)["choices"][0]
        assert choice["finish_reason"] == "abort" and 0 < len(choice["text"])
        assert ref.startswith(choice["text"]) or choice["text"].startswith(ref)
        late = pool.submit(complete, server, max_tokens=3)
        time.sleep(0.5)
        assert not late.done() and is_paused(server)
        assert post(server, "/continue_generation").json()["status"] == "ok"
        assert late.result(timeout=60)["choices"][0]["finish_reason"] == "length"


def test_wait_answers_once_requests_in_flight_finished(server):
    """mode=wait answers after the completion in flight finished whole; clear_cache (the
    default) forgets the prefix cache: the same prompt then hits nothing."""
    prompt = "Tell me about the sea and the ships that sail on it. " * 4  # > one block
    assert complete(server, prompt=prompt, max_tokens=1)  # cached now
    hit = complete(server, prompt=prompt, max_tokens=1)["usage"]["prompt_tokens_details"]
    assert hit["cached_tokens"] >= 16
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        start = made(server)
        busy = pool.submit(complete, server, max_tokens=40, ignore_eos=True)
        wait_for_tokens(server, start + 2)
        assert post(server, "/pause", params={"mode": "wait"}).status_code == 200
        whole = busy.result(timeout=10)  # finished whole, not aborted
        assert whole["choices"][0]["finish_reason"] == "length"
        assert whole["usage"]["completion_tokens"] == 40 and is_paused(server)
    assert post(server, "/resume").status_code == 200
    cold = complete(server, prompt=prompt, max_tokens=1)["usage"]["prompt_tokens_details"]
    assert not cold or cold["cached_tokens"] == 0


def test_refusals_and_the_key(server):
    r = post(server, "/pause", params={"mode": "sleep"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "mode"
    r = post(server, "/pause_generation", {"mode": "retract"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "mode"
    assert "in_place" in r.json()["error"]["message"]
    for path in ("/pause", "/resume", "/pause_generation", "/continue_generation"):
        assert httpx.post(server.url + path).status_code == 401
    assert httpx.get(server.url + "/is_paused").status_code == 401
    assert not is_paused(server)


def test_a_held_request_can_be_aborted_by_name_or_left(server):
    """While paused, a held request is ended by /abort_request naming it (answered at
    once: finish reason abort, no text), another's client leaves, and a third stays held
    through a second pause that aborts the requests in flight; after /resume only that
    third reaches the engine (one prompt looked up in the prefix cache)."""
    queried = "tidal:prefix_cache_queries_total"
    assert post(server, "/pause").status_code == 200
    time.sleep(1.0)  # the core's last report is in
    before = metric(server.url, queried)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        named = pool.submit(complete, server, max_tokens=3, request_id="held-1")
        kept = pool.submit(complete, server, max_tokens=3)
        with pytest.raises(httpx.ReadTimeout):  # the client leaves while held
            httpx.post(server.url + "/v1/completions", headers=AUTH, timeout=0.5,
                       json={"prompt": PROMPT, "max_tokens": 3})
        assert post(server, "/abort_request", {"rid": "held-1"}).status_code == 200
        choice = named.result(timeout=10)["choices"][0]
        assert (choice["finish_reason"], choice["text"]) == ("abort", "")
        assert post(server, "/pause").status_code == 200
        time.sleep(0.3)
        assert not kept.done()
        assert post(server, "/resume").status_code == 200
        answer = kept.result(timeout=60)
    assert answer["choices"][0]["finish_reason"] == "length"
    time.sleep(1.0)  # the core's next report
    assert metric(server.url, queried) - before == answer["usage"]["prompt_tokens"]


def test_a_request_held_by_a_pause_is_answered_at_shutdown(server):
    """SIGTERM ends the wait of a request a pause held: a 503 saying the server shuts down
    (last: it stops the module's server)."""
    assert post(server, "/pause").status_code == 200
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        late = pool.submit(post, server, "/v1/completions",
                           {"prompt": PROMPT, "max_tokens": 3, "temperature": 0})
        time.sleep(0.5)
        assert not late.done()
        server.proc.send_signal(signal.SIGTERM)
        r = late.result(timeout=10)  # at once, not after the drain
    assert r.status_code == 503 and "shutting down" in r.json()["error"]["message"]
