"""--stream-interval: a stream's updates gathered into chunks of that many tokens per
sequence, the first token at once and the rest at the end; and through a real server."""

from __future__ import annotations

import asyncio
import json

import httpx

from server_fixtures import Server
from tidal.core import TokenLogprob
from tidal.engine.outputs import StepUpdate
from tidal.server.stream_interval import every_n_tokens


def update(index: int, tokens: list[int], finished: bool = False) -> StepUpdate:
    return StepUpdate("r", "r", index, tokens, "".join(f"<{t}>" for t in tokens), finished,
                      "length" if finished else None,
                      logprobs=[TokenLogprob(-t / 10, []) for t in tokens])


def test_chunks_hold_the_interval_the_first_token_goes_alone_and_the_end_flushes():
    steps = [(0, update(0, [1])), (1, update(1, [50])), (0, update(0, [2])),
             (0, update(0, [3, 4])), (1, update(1, [51])), (0, update(0, [5])),
             (0, update(0, [6, 7, 8, 9])), (1, update(1, [52], finished=True)),
             (0, update(0, [10], finished=True))]
    closed = []

    async def engine():
        try:
            for step in steps:
                yield step
        finally:
            closed.append(True)

    async def run():
        return [(i, u) async for i, u in every_n_tokens(engine(), 3)]

    got = asyncio.run(run())
    assert [(i, u.new_token_ids) for i, u in got] == [
        (0, [1]), (1, [50]), (0, [2, 3, 4]), (0, [5, 6, 7, 8, 9]), (1, [51, 52]), (0, [10])]
    merged = got[3][1]  # its text and logprobs follow its tokens, in order
    assert merged.new_text == "<5><6><7><8><9>"
    assert [e.logprob for e in merged.logprobs] == [-0.5, -0.6, -0.7, -0.8, -0.9]
    assert [u.finished for _, u in got] == [False, False, False, False, True, True]
    assert closed == [True]

    async def leave():  # the client leaves after the first chunk: the engine's end too
        chunks = every_n_tokens(engine(), 3)
        await chunks.__anext__()
        await chunks.aclose()

    closed.clear()
    asyncio.run(leave())
    assert closed == [True]


def test_a_server_streams_chunks_of_the_interval_with_the_whole_answer():
    server = Server("--stream-interval", "4", "--dtype", "float32")
    try:
        body = {"messages": [{"role": "user", "content": "Count to twenty."}],
                "max_tokens": 14, "temperature": 0, "ignore_eos": True, "logprobs": True}
        whole = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=120).json()
        with httpx.stream("POST", server.url + "/v1/chat/completions", timeout=120,
                          json={**body, "stream": True}) as stream:
            chunks = [json.loads(line[6:]) for line in stream.iter_lines()
                      if line.startswith("data: {")]
        sizes = [len(c["choices"][0]["logprobs"]["content"]) for c in chunks
                 if c["choices"] and c["choices"][0].get("logprobs")]
        assert sizes == [1, 4, 4, 4, 1]
        text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks
                       if c["choices"])
        assert text == whole["choices"][0]["message"]["content"]
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    finally:
        server.stop()
