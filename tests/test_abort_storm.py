"""Clients that give up: storms of streams, chat and completions, some with logprobs, each
abandoned at a random moment from before its answer starts to mid-stream, against a real
`tidal serve`. None may go on decoding for nobody: a stream cancelled while it waited to
send a chunk was once left open until garbage collection, its sequences running on to
max_tokens, uncounted."""

from __future__ import annotations

import asyncio
import contextlib
import random
import time

import httpx
import pytest

from server_fixtures import Server, finished, metric

CLIENTS, STORMS = 60, 5
MAX_TOKENS = 400  # a sequence left decoding runs well past the deadline below


@pytest.fixture(scope="module")
def server():
    s = Server("--max-pending", str(4 * CLIENTS))
    yield s
    s.stop()


async def leave_early(server, c: httpx.AsyncClient, i: int, after: float) -> None:
    body = {"max_tokens": MAX_TOKENS, "ignore_eos": True, "stream": True}
    if i % 2:
        path, body["prompt"] = "/v1/completions", f"Once upon a time {i}"
        body["logprobs"] = 2 if i % 7 == 0 else None
    else:
        path, body["messages"] = "/v1/chat/completions", [{"role": "user", "content": f"A {i}"}]
        body["logprobs"] = i % 7 == 0

    async def read() -> None:
        async with c.stream("POST", server.url + path, json=body) as r:
            async for _ in r.aiter_bytes():
                pass

    with contextlib.suppress(asyncio.TimeoutError, httpx.HTTPError):  # given up
        await asyncio.wait_for(read(), after)


async def storm(server, rng: random.Random) -> None:
    async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=CLIENTS)) as c:
        await asyncio.gather(*(leave_early(server, c, i, rng.uniform(0.05, 2.0))
                               for i in range(CLIENTS)))


def test_no_sequence_of_clients_that_left_decodes_on(server):
    """The server counts only the requests it received (one given up within 20 ms may never
    arrive), so the proof is time: sequences aborted as they should be leave nothing
    running within seconds, while one left decoding runs on for many."""
    rng = random.Random(11)
    httpx.post(server.url + "/v1/completions", timeout=60, json={
        "prompt": "Hi", "max_tokens": 1, "logprobs": 1})  # logprobs' one-off set-up, first
    for _ in range(STORMS):
        aborted, lengths = finished(server, "abort"), finished(server, "length")
        asyncio.run(storm(server, rng))
        deadline = time.monotonic() + 6
        while metric(server.url, "tidal:num_requests_running") > 0 or \
                metric(server.url, "tidal:num_requests_waiting") > 0:
            assert time.monotonic() < deadline, "sequences left decoding for clients that left"
            time.sleep(0.1)
        assert finished(server, "length") == lengths  # none ran to the end
        assert aborted < finished(server, "abort") <= aborted + CLIENTS
    assert metric(server.url, "tidal:kv_cache_used_blocks") == 0
