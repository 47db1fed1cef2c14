"""Engine-core death and recovery with a real server: a SIGKILLed core fails only its
in-flight requests and is restarted (`--restart-core`, `--restart-backoff`) without
restarting the server; once the retries are spent the server answers 503 and /health says
why. Data parallel: the other core serves on and the restarted one rejoins. P/D: the router
finds a restarted prefill core at its new KV address."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time

import httpx
import openai

from server_fixtures import Server, metric, pid_alive

MODEL = "smollm2-135m"


def wait_until(cond, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def health(url: str) -> httpx.Response:
    return httpx.get(url + "/health", timeout=10)


def labelled(url: str, name: str, core: int) -> float:
    return metric(url, f'{name}{{core="{core}"}}')


def stream_in_background(client: openai.OpenAI, result: dict, key, started: threading.Event,
                         max_tokens: int = 300) -> threading.Thread:
    """A stream on a thread (`started` once its first chunk came); its text or its APIError
    lands in result[key]."""
    def run() -> None:
        try:
            chunks = client.completions.create(model=MODEL, prompt="Once upon a time",
                                               max_tokens=max_tokens,
                                               temperature=0, stream=True,
                                               extra_body={"ignore_eos": True})
            text = ""
            for c in chunks:
                started.set()
                text += c.choices[0].text if c.choices else ""
            result[key] = text
        except openai.APIError as exc:
            result[key] = exc
    t = threading.Thread(target=run)
    t.start()
    return t


def test_a_killed_core_is_restarted_until_its_retries_are_spent():
    s = Server("--restart-core", "1", "--restart-backoff", "0.5", "--max-pending", "2")
    try:
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0)
        first = s.core_pid()
        result: dict = {}
        started = [threading.Event(), threading.Event()]
        threads = [stream_in_background(client, result, i, started[i]) for i in range(2)]
        for e in started:
            assert e.wait(60)
        os.kill(first, signal.SIGKILL)
        for t in threads:
            t.join(60)
        assert all(isinstance(result[i], openai.APIError) for i in range(2)), result
        assert "engine core 0" in str(result[0])
        # restarting: new requests get a 503 at once, saying so, with Retry-After
        r = httpx.post(s.url + "/v1/completions", json={"prompt": "hi"}, timeout=10)
        assert r.status_code == 503 and "restarting" in r.json()["error"]["message"]
        assert int(r.headers["retry-after"]) >= 1
        h = health(s.url)
        assert h.status_code == 503 and h.json()["restarting"] is True
        wait_until(lambda: health(s.url).status_code == 200)
        h = health(s.url).json()
        assert h["core_restarts"] == 1 and h["restarting"] is False
        second = h["engine_core_pid"]
        assert second != first and not pid_alive(first)
        # the failed requests left nothing behind: two at a time fit --max-pending 2 again
        again: dict = {}
        threads = [threading.Thread(target=lambda i=i: again.__setitem__(
            i, client.completions.create(model=MODEL, prompt="The sea", max_tokens=8,
                                         temperature=0))) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert [again[i].choices[0].finish_reason for i in range(2)] == ["length", "length"]
        assert labelled(s.url, "tidal:engine_core_restarts_total", 0) == 1
        assert labelled(s.url, "tidal:engine_core_up", 0) == 1
        # the one restart is spent: the next death is for good
        os.kill(second, signal.SIGKILL)
        wait_until(lambda: health(s.url).status_code == 503)
        h = health(s.url)
        assert h.json()["restarting"] is False and "retry-after" not in h.headers
        assert "--restart-core 1" in h.json()["error"]["message"]
        t0 = time.monotonic()
        r = httpx.post(s.url + "/v1/completions", json={"prompt": "hi"}, timeout=10)
        assert r.status_code == 503 and time.monotonic() - t0 < 2
        assert labelled(s.url, "tidal:engine_core_up", 0) == 0
        assert s.proc.poll() is None  # the server itself stays up
    finally:
        s.stop()


def test_a_hung_core_is_killed_failing_its_requests_and_restarted():
    """A SIGSTOPped core answers nothing: past --core-hang-timeout the watchdog kills it,
    its in-flight request fails, /health says so, and the restarted core serves."""
    s = Server("--restart-core", "1", "--restart-backoff", "0.2", "--core-hang-timeout", "2")
    try:
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0)
        first = s.core_pid()
        result: dict = {}
        started = threading.Event()
        thread = stream_in_background(client, result, 0, started)
        assert started.wait(60)
        os.kill(first, signal.SIGSTOP)
        t0 = time.monotonic()
        thread.join(30)
        assert isinstance(result[0], openai.APIError) and "core-hang-timeout" in str(result[0])
        assert 1 <= time.monotonic() - t0 < 10  # the timeout counts from its last heartbeat
        wait_until(lambda: health(s.url).status_code == 200)
        assert health(s.url).json()["engine_core_pid"] != first and not pid_alive(first)
        out = client.completions.create(model=MODEL, prompt="The sea", max_tokens=4)
        assert out.choices[0].finish_reason == "length"
    finally:
        s.stop()


def test_a_data_parallel_core_is_restarted_and_rejoins_while_the_other_serves():
    s = Server("--data-parallel-size", "2", "--dp-routing", "round_robin",
               "--dp-batch-timeout", "0.01", "--restart-backoff", "0.5")
    try:
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0)
        pids = health(s.url).json()["engine_core_pids"]
        result: dict = {}
        started = [threading.Event(), threading.Event()]
        threads = []
        for i in range(2):  # round robin: one stream on each core
            threads.append(stream_in_background(client, result, i, started[i], max_tokens=64))
            assert started[i].wait(60)
        os.kill(pids[1], signal.SIGKILL)
        wait_until(lambda: health(s.url).json()["restarting"])
        # core 0 serves on while core 1 restarts
        while_down = client.completions.create(model=MODEL, prompt="Hello", max_tokens=4)
        assert while_down.choices[0].finish_reason == "length"
        for t in threads:
            t.join(120)
        assert isinstance(result[1], openai.APIError) and "engine core 1" in str(result[1])
        assert isinstance(result[0], str) and result[0]
        wait_until(lambda: all(c["up"] for c in health(s.url).json()["cores"]))
        h = health(s.url).json()
        assert h["core_restarts"] == 1 and h["cores"][1]["restarts"] == 1
        assert h["engine_core_pids"][0] == pids[0] and h["engine_core_pids"][1] != pids[1]
        assert h["dead_cores"] == {}
        before = labelled(s.url, "tidal:dp_requests_routed_total", 1)
        for _ in range(2):  # round robin reaches the restarted core again
            out = client.completions.create(model=MODEL, prompt="Hello", max_tokens=4)
            assert out.choices[0].finish_reason == "length"
        assert labelled(s.url, "tidal:dp_requests_routed_total", 1) == before + 1
        assert labelled(s.url, "tidal:engine_core_up", 1) == 1
    finally:
        s.stop()


def test_the_router_finds_a_restarted_prefill_core_at_its_new_address():
    pd = Server("--pd", "1P1D", "--restart-backoff", "0.5")
    try:
        routes = health(pd.url).json()
        prefill = routes["prefill"][0]
        old = health(prefill).json()["engine_core_pid"]
        body = {"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}
        ok = httpx.post(pd.url + "/v1/completions", json=body, timeout=60)
        assert ok.status_code == 200
        os.kill(old, signal.SIGKILL)
        wait_until(lambda: health(prefill).status_code == 503)
        assert health(pd.url).status_code == 503  # the router looked: out of rotation
        r = httpx.post(pd.url + "/v1/completions", json=body, timeout=10)
        assert r.status_code == 503 and "no prefill instance" in r.json()["error"]["message"]
        wait_until(lambda: health(prefill).status_code == 200)
        assert health(prefill).json()["core_restarts"] == 1

        def served() -> bool:
            r = httpx.post(pd.url + "/v1/completions", json=body, timeout=30)
            assert r.status_code in (200, 503), r.text
            return r.status_code == 200
        wait_until(served, 30)
        again = httpx.post(pd.url + "/v1/completions", json=body, timeout=30)
        assert again.json()["choices"][0]["text"] == ok.json()["choices"][0]["text"]
    finally:
        pd.stop()


STREAM_TOKENS = 300  # decoding still when the long prompt arrives, on a fast host too


def test_a_long_step_under_full_load_is_no_hang():
    """A prefill of ~2,500 tokens in one step (no step-time cap) beside streams decoding, with
    --core-hang-timeout at 1 s: the streams freeze for longer than the timeout (the step is
    longer), yet the core's heartbeat thread speaks through it, so nothing is killed."""
    s = Server("--core-hang-timeout", "1", "--max-step-ms", "0")
    try:
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0)
        pid = s.core_pid()
        gaps: list[float] = []

        def stream() -> None:
            last = None
            for _ in client.completions.create(model=MODEL, prompt="Once upon a time",
                                               max_tokens=STREAM_TOKENS, temperature=0,
                                               stream=True,
                                               extra_body={"ignore_eos": True}):
                now = time.monotonic()
                gaps.append(now - last if last is not None else 0.0)
                last = now

        threads = [threading.Thread(target=stream) for _ in range(4)]
        for t in threads:
            t.start()
        time.sleep(1.0)
        words = " ".join(f"word{i % 97} river{i % 13}" for i in range(450))
        long = client.completions.create(model=MODEL, prompt=words, max_tokens=2)
        for t in threads:
            t.join(120)
        assert long.usage.prompt_tokens > 2000 and long.choices[0].finish_reason == "length"
        assert max(gaps) > 1.0, max(gaps)  # a step longer than the hang timeout happened
        assert len(gaps) == 4 * STREAM_TOKENS  # every stream ended whole
        assert s.core_pid() == pid and health(s.url).json()["core_restarts"] == 0
    finally:
        s.stop()


def test_a_stall_of_the_frontends_own_loop_is_no_silence_of_a_core():
    """The frontend's event loop blocked for longer than the hang timeout (a heavy request
    parsed on the loop, a slow GC): the watchdog's next tick comes before the heartbeats
    queued behind it are read, and must not kill a live core for it."""
    from tidal.runtime.core_watch import CoreWatch, RestartPolicy

    class Alive:
        pid, killed = 1, False

        def alive(self) -> bool:
            return not self.killed

        def kill(self) -> None:
            self.killed = True

    async def main() -> tuple[bool, bool]:
        handle = Alive()
        watch = CoreWatch(1, RestartPolicy(max_restarts=0, hang_timeout=0.5),
                          launch=lambda *a: handle, on_down=lambda *a: None,
                          on_up=lambda *a: None, on_gone=lambda *a: None, handles=[handle])
        watch.cores[0].up, watch.cores[0].last_heard = True, time.monotonic()
        task = asyncio.create_task(watch.run())
        await asyncio.sleep(0.3)
        watch.heard(0)
        time.sleep(1.5)  # the loop blocked: heartbeats pile up unread meanwhile
        await asyncio.sleep(0.05)  # the watchdog's overdue tick runs before any read
        killed_by_stall = handle.killed
        watch.heard(0)  # the queued heartbeats, read
        await asyncio.sleep(1.0)  # then a real silence past the timeout is noticed
        watch.close()
        task.cancel()
        return killed_by_stall, handle.killed

    assert asyncio.run(main()) == (False, True)
