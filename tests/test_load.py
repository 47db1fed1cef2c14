"""The load reports routers and RL frameworks poll (tidal/server/load.py): vLLM's /load counts
the requests being answered until their last byte (a client that leaves included), SGLang's
/v1/loads and /get_load report the core's running requests, KV tokens and throughput while
it works and its sections, filters and Prometheus form; behind the key; and the stats
board's generation rate per core across a restart."""

from __future__ import annotations

import concurrent.futures
import time

import httpx
import pytest

from server_fixtures import Server
from tidal.core.invariants import SchedulerStats
from tidal.engine import messages as m
from tidal.runtime import core_stats
from tidal.runtime.core_stats import CoreStatsBoard

KEY = "load-test-key"
AUTH = {"authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def server():
    s = Server("--api-key", KEY, "--max-num-seqs", "4")
    yield s
    s.stop()


def get(server, path: str, **params):
    r = httpx.get(server.url + path, headers=AUTH, params=params, timeout=10)
    assert r.status_code == 200, r.text
    return r.json() if "json" in r.headers["content-type"] else r.text


def wait_for(probe, what: str, timeout: float = 30):
    deadline = time.monotonic() + timeout
    while not (got := probe()):
        assert time.monotonic() < deadline, f"never {what}"
        time.sleep(0.1)
    return got


def stream_until_told(server, stop, tokens: int = 400) -> int:
    """A chat stream read chunk by chunk until `stop` is set (then left: the client goes)."""
    body = {"model": get(server, "/v1/models")["data"][0]["id"], "messages": [{"role": "user", "content": "Count to a thousand."}],
            "max_tokens": tokens, "ignore_eos": True, "stream": True}
    chunks = 0
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, headers=AUTH,
                      timeout=120) as r:
        assert r.status_code == 200
        for _ in r.iter_lines():
            chunks += 1
            if stop.is_set():
                break
    return chunks


def test_load_counts_requests_until_their_answers_end_or_their_clients_leave(server):
    import threading

    assert get(server, "/load") == {"server_load": 0}
    stops = [threading.Event() for _ in range(6)]  # 4 running, 2 waiting (--max-num-seqs 4)
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        streams = [pool.submit(stream_until_told, server, stop) for stop in stops]
        wait_for(lambda: get(server, "/load")["server_load"] == 6, "six requests counted")
        assert get(server, "/v1/models")["data"]  # not a route that puts work on the engine
        assert get(server, "/load")["server_load"] == 6

        def busy():
            load = get(server, "/v1/loads")["loads"][0]
            return load if load["num_running_reqs"] == 4 and load["gen_throughput"] > 0 \
                else None
        core = wait_for(busy, "four running and tokens coming")
        assert core["num_waiting_reqs"] == 2 and core["num_total_reqs"] == 6
        assert 0 < core["num_used_tokens"] <= core["max_total_num_tokens"]
        assert core["token_usage"] == pytest.approx(
            core["num_used_tokens"] / core["max_total_num_tokens"], abs=1e-9)
        assert core["num_total_tokens"] >= core["num_used_tokens"]
        old = get(server, "/get_load")
        assert [(d["dp_rank"], d["num_reqs"]) for d in old] == [(0, 6)]
        assert old[0]["num_tokens"] >= old[0]["num_pending_tokens"] >= 0
        for stop in stops[:3]:  # three clients leave
            stop.set()
        wait_for(lambda: get(server, "/load")["server_load"] <= 3, "the leavers uncounted")
        for stop in stops[3:]:
            stop.set()
        assert all(s.result() > 0 for s in streams)
    wait_for(lambda: get(server, "/load")["server_load"] == 0, "nothing counted at the end")
    wait_for(lambda: get(server, "/v1/loads")["aggregate"]["total_reqs"] == 0,
             "the core's queues empty")


def test_v1_loads_sections_filters_and_prometheus(server):
    every = get(server, "/v1/loads", include="all")
    assert every["dp_rank_count"] == 1 and every["version"]
    (core,) = every["loads"]
    assert core["memory"]["token_capacity"] == core["max_total_num_tokens"]
    assert core["memory"]["kv_cache_gb"] > 0
    assert set(core["queues"]) == {"waiting", "retracted", "transferring"}
    assert "lora" not in core and "disaggregation" not in core  # no adapters, not P/D
    plain = get(server, "/v1/loads")["loads"][0]
    assert "memory" not in plain and "queues" not in plain
    assert get(server, "/v1/loads", include="core,memory")["loads"][0]["memory"]
    assert get(server, "/v1/loads", dp_rank=0)["dp_rank_count"] == 1
    text = get(server, "/v1/loads", format="prometheus", include="memory")
    assert 'sglang_num_running_reqs{dp_rank="0"} 0' in text
    assert "# TYPE sglang_memory_token_capacity gauge" in text
    assert f'sglang_max_total_num_tokens{{dp_rank="0"}} {core["max_total_num_tokens"]}' in text


@pytest.mark.parametrize("params, param", [({"include": "core,bogus"}, "include"),
                                           ({"dp_rank": 1}, "dp_rank"),
                                           ({"format": "xml"}, "format")])
def test_v1_loads_refusals_name_the_parameter(server, params, param):
    r = httpx.get(server.url + "/v1/loads", headers=AUTH, params=params)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


@pytest.mark.parametrize("path", ["/load", "/get_load", "/v1/loads"])
def test_load_reports_are_behind_the_key(server, path):
    assert httpx.get(server.url + path).status_code == 401


def stats(tokens: int, incarnation: int = 0) -> m.Stats:
    zero = {name: 0 for name in SchedulerStats.__dataclass_fields__}
    zero.update(kv_usage=0.0, new_token_ratio=0.0, prefix_hit_rate=0.0, tier_load_ms=0.0,
                running_loras=[], waiting_loras=[])
    return m.Stats(0, 0, SchedulerStats(**zero), 0, tokens, incarnation=incarnation)


def test_the_generation_rate_spans_a_second_of_reports_and_restarts_at_a_new_core(
        monkeypatch):
    now = [1000.0]
    monkeypatch.setattr(core_stats.time, "time", lambda: now[0])
    board = CoreStatsBoard(1)
    board.record(stats(0))
    for t, tokens in ((0.5, 40), (1.0, 100)):  # the rate waits for a second of reports
        now[0] = 1000 + t
        board.record(stats(tokens))
    assert board.gen_rate[0] == pytest.approx(100.0) and board.arrived[0] == 1001.0
    now[0] = 1001.5
    board.record(stats(130))
    assert board.gen_rate[0] == pytest.approx(100.0)  # not yet a second since the last
    now[0] = 1002.0
    board.record(stats(150))
    assert board.gen_rate[0] == pytest.approx(50.0)
    now[0] = 1002.2
    board.record(stats(7, incarnation=1))  # a restarted core counts from 0 again
    assert board.gen_rate[0] == 0.0
    now[0] = 1003.2
    board.record(stats(27, incarnation=1))
    assert board.gen_rate[0] == pytest.approx(20.0)
