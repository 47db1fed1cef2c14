"""Weight updates in place (tidal/server/weight_updates.py), end to end on a keyed server of
a tiny model: SGLang's /update_weights_from_disk serves a checkpoint's weights (greedy tokens
as an engine of those weights gives them, /health 200 throughout) and the old ones again; a
stream in flight finishes on the weights it began with, or ends answered with
`abort_all_requests`, and a pause in place holds through it; another architecture, a
missing path, a load format and weights that do not load are refused, the old weights
serving on; and what keys a model's weights sees a checkpoint written again."""

from __future__ import annotations

import concurrent.futures
import json
import shutil
import threading
import time

import httpx
import pytest

from server_fixtures import Server, pid_alive
from tidal.core import SamplingParams
from tidal.engine.config import EngineConfig
from tidal.engine.core import EngineCore
from tidal.model.registry import model_files

from model_fixtures import small_folder

KEY = "weights-key"
AUTH = {"authorization": f"Bearer {KEY}"}
PROMPT = [5, 6, 7, 8, 9]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Two checkpoints of one shape (seeds 0 and 1), one deeper, and one whose weights file
    is cut short."""
    tmp = tmp_path_factory.mktemp("weights")
    long = {"max_position_embeddings": 4096}  # a stream long enough to be caught in flight
    a, b = (small_folder(tmp, name, "llama", seed=seed, **long)
            for name, seed in (("a", 0), ("b", 1)))
    deep = small_folder(tmp, "deep", "llama", num_hidden_layers=3, **long)
    broken = shutil.copytree(b, tmp / "broken")
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    return a, b, deep, broken


@pytest.fixture(scope="module")
def server(models):
    s = Server("--model", str(models[0]), "--api-key", KEY, "--dtype", "float32")
    yield s
    s.stop()


def post(server, path, body, **kw):
    return httpx.post(server.url + path, json=body, headers=AUTH, timeout=120, **kw)


def greedy(server, n: int = 8) -> list[int]:
    r = post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": n, "temperature": 0,
                                         "ignore_eos": True, "return_token_ids": True})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


def engine_greedy(folder, n: int = 8) -> list[int]:
    """The same request on an engine core of `folder`'s weights in this process."""
    core = EngineCore(EngineConfig.from_kwargs(model=str(folder), dtype="float32",
                                               num_kv_blocks=64, num_threads=1), folder)
    core.add("r", PROMPT, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
    tokens = []
    while core.has_work():
        tokens += [t for o in core.step() for t in o.new_token_ids]
    core.close()
    return tokens


def update(server, path, **body):
    return post(server, "/update_weights_from_disk", {"model_path": str(path), **body})


def test_new_weights_serve_and_the_old_come_back(server, models):
    a, b = models[:2]
    old = greedy(server)
    assert old == engine_greedy(a)
    health, done = [], threading.Event()

    def watch() -> None:  # the server stays up while its cores start on the new weights
        while not done.is_set():
            health.append(httpx.get(server.url + "/health").status_code)
            time.sleep(0.05)

    watcher = threading.Thread(target=watch)
    watcher.start()
    r = update(server, b, weight_version="step-1")
    done.set()
    watcher.join()
    assert r.status_code == 200 and r.json()["success"] is True, r.text
    assert len(health) > 10 and set(health) == {200}
    new = greedy(server)
    assert new == engine_greedy(b) and new != old
    assert httpx.get(server.url + "/get_weight_version", headers=AUTH).json() == {
        "weight_version": "step-1"}
    info = httpx.get(server.url + "/get_model_info", headers=AUTH).json()
    assert info["model_path"] == str(b) and info["weight_version"] == "step-1"
    assert update(server, a).json()["success"] is True
    assert greedy(server) == old
    assert httpx.get(server.url + "/get_weight_version", headers=AUTH).json()[
        "weight_version"] == "step-1"  # none named: the last one stays


@pytest.mark.parametrize("abort", [False, True])
def test_a_stream_in_flight_finishes_first_or_is_answered_aborted(server, models, abort):
    a, b = models[:2]
    n = 3000 if abort else 200  # aborted: a stream of seconds, caught in flight
    body = {"prompt": PROMPT, "max_tokens": n, "temperature": 0, "ignore_eos": True,
            "stream": True, "return_token_ids": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, headers=AUTH,
                      timeout=120) as r:
        lines = (ln for ln in r.iter_lines() if ln.startswith("data: {"))
        chunks = [json.loads(next(lines)[6:])["choices"][0]]
        assert update(server, b, abort_all_requests=abort).json()["success"] is True
        chunks += [json.loads(ln[6:])["choices"][0] for ln in lines]
    tokens = [t for c in chunks for t in c["token_ids"]]
    assert tokens == engine_greedy(a, len(tokens))  # all on the weights it began with
    assert (chunks[-1]["finish_reason"], len(tokens) < n) == (
        ("abort", True) if abort else ("length", False))
    assert greedy(server) == engine_greedy(b)
    assert update(server, a).json()["success"] is True


def test_a_pause_in_place_holds_through_an_update(server, models):
    """Requests held by a pause in place never finish: an update refuses to wait for them,
    or ends them answered (`abort_all_requests`); the server stays paused until resumed."""
    a, b = models[:2]
    body = {"prompt": PROMPT, "max_tokens": 3000, "temperature": 0, "ignore_eos": True,
            "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, headers=AUTH,
                      timeout=120) as r:
        lines = (ln for ln in r.iter_lines() if ln.startswith("data: {"))
        next(lines)
        assert post(server, "/pause", None, params={"mode": "keep"}).status_code == 200
        refused = update(server, b)
        assert refused.status_code == 400
        assert refused.json()["error"]["param"] == "abort_all_requests"
        assert update(server, b, abort_all_requests=True).json()["success"] is True
        last = json.loads(list(lines)[-1][6:])["choices"][0]
    assert last["finish_reason"] == "abort"
    assert httpx.get(server.url + "/is_paused", headers=AUTH).json() == {"is_paused": True}
    assert post(server, "/resume", None).status_code == 200
    assert greedy(server) == engine_greedy(b)
    assert update(server, a).json()["success"] is True


def test_asleep_the_cores_are_gone_and_requests_wait_for_the_wake(server, models):
    """vLLM's /sleep ends a stream in flight answered and stops the engine core (its process
    gone, /health 200); a request sent meanwhile waits and is answered after /wake_up, by
    a new core with the same weights; SGLang's release and resume do the same, finishing
    what runs first; a weight update waits for the wake."""
    a = models[0]
    want, pid = greedy(server), server.core_pid()
    body = {"prompt": PROMPT, "max_tokens": 3000, "temperature": 0, "ignore_eos": True,
            "stream": True}
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        with httpx.stream("POST", server.url + "/v1/completions", json=body, headers=AUTH,
                          timeout=120) as r:
            lines = (ln for ln in r.iter_lines() if ln.startswith("data: {"))
            next(lines)
            assert post(server, "/sleep", None, params={"level": 2}).status_code == 200
            last = json.loads(list(lines)[-1][6:])["choices"][0]
        assert last["finish_reason"] == "abort"
        asleep = httpx.get(server.url + "/is_sleeping", headers=AUTH).json()
        assert asleep == {"is_sleeping": True} and not pid_alive(pid)
        assert httpx.get(server.url + "/health").status_code == 200
        assert post(server, "/sleep", None).status_code == 200  # asleep already: no change
        late = pool.submit(greedy, server)
        time.sleep(0.5)
        assert not late.done()
        refused = update(server, a)
        assert refused.status_code == 400 and "wake" in refused.json()["message"]
        assert post(server, "/wake_up", None, params={"tags": "weights"}).status_code == 200
        assert late.result(timeout=60) == want and server.core_pid() != pid
    assert httpx.get(server.url + "/is_sleeping", headers=AUTH).json() == {
        "is_sleeping": False}
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        busy = pool.submit(greedy, server, 200)
        time.sleep(0.05)
        assert post(server, "/release_memory_occupation", {"tags": ["kv_cache"]}
                    ).status_code == 200
        done = busy.result(timeout=60)
        assert len(done) == 200 and done[:8] == want  # finished, whole
        assert post(server, "/resume_memory_occupation", {}).status_code == 200
    assert greedy(server) == want
    r = post(server, "/sleep", None, params={"level": 3})
    assert r.status_code == 400 and r.json()["error"]["param"] == "level"
    r = post(server, "/wake_up", None, params={"tags": "gpu"})
    assert r.status_code == 400 and r.json()["error"]["param"].startswith("tags")
    assert httpx.post(server.url + "/sleep").status_code == 401


def test_what_cannot_serve_is_refused_and_the_old_weights_serve_on(server, models, tmp_path):
    a, _, deep, broken = models
    before = greedy(server)
    for path, body, words in [
            (deep, {}, "num_hidden_layers 3 (served: 2)"),
            (tmp_path / "nowhere", {}, "neither an embedded model"),
            (broken, {}, "did not load"),
            (a, {"load_format": "dummy"}, "load_format 'dummy'")]:
        r = update(server, path, **body)
        assert r.status_code == 400 and r.json()["success"] is False, r.text
        error = r.json()["error"]
        assert words in error["message"] and r.json()["message"] == error["message"]
        assert error["param"] == ("load_format" if "load_format" in body else "model_path")
        assert greedy(server) == before
    assert httpx.get(server.url + "/health").status_code == 200
    r = post(server, "/update_weights_from_disk", {})
    assert r.status_code == 400 and r.json()["error"]["param"] == "model_path"
    assert httpx.post(server.url + "/update_weights_from_disk",
                      json={"model_path": str(a)}).status_code == 401


def test_weights_written_again_in_place_are_other_weights(tmp_path):
    """What keys the disk KV tier and the step-time profile to a model's weights: every
    safetensors shard, so that a checkpoint written again in place is not the old one."""
    (tmp_path / "config.json").write_text("{}")
    shards = [tmp_path / f"model-0000{i}-of-00002.safetensors" for i in (1, 2)]
    for shard in shards:
        shard.write_bytes(b"x" * 10)
    before = model_files(tmp_path)
    assert set(before) == {"config.json", *(s.name for s in shards)}
    time.sleep(0.05)
    shards[1].write_bytes(b"y" * 10)  # the same size
    assert model_files(tmp_path) != before
