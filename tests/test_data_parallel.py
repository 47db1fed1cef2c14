"""End to end: `tidal serve --data-parallel-size 2` (two engine cores, one thread each, behind
the dispatcher) driven by the official `openai` client, including a core's death."""

from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import openai
import pytest

from server_fixtures import Server, metric, pid_alive

PROMPTS = ["The capital of France is", "Once upon a time", "1, 2, 3, 4,",
           "The best way to learn", "Water boils at", "My favourite colour is"]


def routed(url: str, core: int) -> float:
    return metric(url, f'tidal:dp_requests_routed_total{{core="{core}"}}')


@pytest.fixture(scope="module")
def dp():
    s = Server("--data-parallel-size", "2", "--dtype", "float32", "--dp-batch-timeout", "0.05")
    yield s
    s.stop()


def test_two_cores_share_the_requests_and_answer_as_one_engine_does(dp):
    client = openai.OpenAI(base_url=dp.url + "/v1", api_key="x", max_retries=0)
    outs = [client.completions.create(model="smollm2-135m", prompt=p, max_tokens=12,
                                      temperature=0) for p in PROMPTS]
    one_by_one = [o.choices[0].text for o in outs]
    generated = 2 * sum(o.usage.completion_tokens for o in outs)
    together: dict[int, str] = {}

    def ask(i: int) -> None:
        together[i] = client.completions.create(model="smollm2-135m", prompt=PROMPTS[i],
                                                max_tokens=12, temperature=0).choices[0].text
    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [together[i] for i in range(len(PROMPTS))] == one_by_one
    assert routed(dp.url, 0) >= 3 and routed(dp.url, 1) >= 3
    assert routed(dp.url, 0) + routed(dp.url, 1) == 2 * len(PROMPTS)
    deadline = time.monotonic() + 5  # the cores report stats every 0.5 s
    while metric(dp.url, "tidal:generation_tokens_total") < generated:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert metric(dp.url, "tidal:generation_tokens_total") == generated
    health = httpx.get(dp.url + "/health").json()
    assert len(health["engine_core_pids"]) == 2 and health["dead_cores"] == {}
    loads = httpx.get(dp.url + "/v1/loads").json()  # SGLang's: a report per core
    assert [d["dp_rank"] for d in loads["loads"]] == [0, 1] and loads["dp_rank_count"] == 2
    assert loads["aggregate"]["total_tokens"] == sum(d["num_total_tokens"]
                                                     for d in loads["loads"])
    assert [d["dp_rank"] for d in httpx.get(dp.url + "/v1/loads?dp_rank=1").json()["loads"]
            ] == [1]
    assert [d["dp_rank"] for d in httpx.get(dp.url + "/get_load").json()] == [0, 1]


def two_cores_never_restarted() -> tuple[Server, openai.OpenAI, list[int]]:
    """A server of two cores, round robin, whose dead cores stay dead: (it, a client on it,
    the cores' pids)."""
    s = Server("--data-parallel-size", "2", "--dp-routing", "round_robin",
               "--dp-batch-timeout", "0.01", "--restart-core", "0")
    client = openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0)
    return s, client, httpx.get(s.url + "/health").json()["engine_core_pids"]


def test_a_dead_core_fails_only_its_requests_and_the_other_serves_on():
    s, client, pids = two_cores_never_restarted()
    try:
        results: dict[int, object] = {}
        started = threading.Barrier(5)

        def stream(i: int) -> None:
            try:
                chunks = client.completions.create(
                    model="smollm2-135m", prompt=PROMPTS[i], max_tokens=300, temperature=0,
                    stream=True, extra_body={"ignore_eos": True})
                text, first = "", True
                for c in chunks:
                    if first:
                        first = False
                        started.wait(60)
                    text += c.choices[0].text if c.choices else ""
                results[i] = text
            except openai.APIError as exc:
                results[i] = exc
        threads = [threading.Thread(target=stream, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        started.wait(60)  # every stream has its first token: both cores are decoding
        os.kill(pids[0], signal.SIGKILL)
        for t in threads:
            t.join(120)
        failed = [i for i, r in results.items() if isinstance(r, Exception)]
        assert len(failed) == 2, results  # round robin put two on each core
        assert all("engine core 0" in str(results[i]) for i in failed)
        assert all(isinstance(results[i], str) for i in set(range(4)) - set(failed))
        health = httpx.get(s.url + "/health")
        assert health.status_code == 200 and list(health.json()["dead_cores"]) == ["0"]
        again = client.completions.create(model="smollm2-135m", prompt="Hello", max_tokens=4)
        assert again.choices[0].finish_reason == "length"
        assert pid_alive(pids[1])
    finally:
        s.stop()
    assert not pid_alive(pids[1])


def test_requests_sent_before_a_death_is_seen_go_to_the_live_core():
    """Deaths are seen within a poll (0.2 s): requests routed to the dead core meanwhile
    have produced nothing, so they are served by the live core instead of failing."""
    s, client, pids = two_cores_never_restarted()
    try:
        results: dict[int, object] = {}

        def ask(i: int) -> None:
            try:
                results[i] = client.completions.create(
                    model="smollm2-135m", prompt=PROMPTS[i], max_tokens=4).choices[0].text
            except openai.APIError as exc:
                results[i] = exc
        os.kill(pids[0], signal.SIGKILL)
        threads = [threading.Thread(target=ask, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert all(isinstance(r, str) for r in results.values()) and len(results) == 4, results
        assert routed(s.url, 1) == 4  # round robin sent half to core 0: all ran on core 1
        assert list(httpx.get(s.url + "/health").json()["dead_cores"]) == ["0"]
    finally:
        s.stop()


def test_ray_backend_places_the_cores_as_actors_behind_the_same_dispatcher():
    pytest.importorskip("ray")
    s = Server("--data-parallel-size", "2", "--dp-backend", "ray", "--dtype", "float32",
               "--dp-routing", "round_robin")
    try:
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0)
        texts = [client.completions.create(model="smollm2-135m", prompt=p, max_tokens=8,
                                           temperature=0).choices[0].text for p in PROMPTS[:2]]
        pids = httpx.get(s.url + "/health").json()["engine_core_pids"]
        assert routed(s.url, 0) == routed(s.url, 1) == 1
        assert all(pid_alive(p) for p in pids)
    finally:
        log = s.stop()
    assert "_CoreActor" in log  # Ray's log prefix: the cores ran as actors
    local = Server("--dtype", "float32")
    try:
        client = openai.OpenAI(base_url=local.url + "/v1", api_key="x", max_retries=0)
        assert texts == [client.completions.create(model="smollm2-135m", prompt=p, max_tokens=8,
                                                   temperature=0).choices[0].text
                         for p in PROMPTS[:2]]
    finally:
        local.stop()
    deadline = time.monotonic() + 20  # Ray tears its workers down after the driver exits
    while any(pid_alive(p) for p in pids):
        assert time.monotonic() < deadline, "Ray actors outlived the server"
        time.sleep(0.2)


@pytest.mark.parametrize("tp, pp, in_flight, threads", [
    (1, 1, None, 4), (2, 1, None, 2), (4, 1, None, 1), (1, 2, None, 4), (2, 2, None, 2),
    (1, 2, 2, 2), (2, 2, 2, 1)])
def test_data_parallel_cores_and_their_ranks_share_the_machines_cores(tp, pp, in_flight,
                                                                       threads):
    """Eight cores, two data-parallel engine cores: the ranks of each core that compute at
    once get 8 / (2 x ranks) threads each, unless the flag says otherwise. Pipeline
    stages on one machine take turns (one step in flight), so a stage's tp ranks compute
    at once; with a step in flight per stage, all of them do."""
    from tidal.engine.config import EngineConfig
    from tidal.runtime.client import core_config

    options = dict(data_parallel_size=2, tensor_parallel_size=tp, pipeline_parallel_size=pp,
                   batches_in_flight=in_flight)
    config = EngineConfig.from_kwargs(**options)
    assert config.scheduler.steps_in_flight == (in_flight or 1)
    assert core_config(config, 8).model.num_threads == threads
    given = EngineConfig.from_kwargs(**options, num_threads=3)
    assert core_config(given, 8).model.num_threads == 3
