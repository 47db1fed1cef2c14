"""The online Batch API with the official `openai` client on a real server: files uploaded,
listed, read and deleted; a batch whose good lines answer as the live API does and whose bad
lines land in the error file; a server killed mid-batch and restarted on the same store
finishes it with every line answered exactly once; a cancelled batch keeps the answers it
has; a live stream is answered while a batch runs."""

from __future__ import annotations

import json
import os
import signal
import time

import httpx
import openai
import pytest

from server_fixtures import Server, finished, openai_client
from tidal.server.batches.store import BatchStore

CHAT = {"max_tokens": 6, "temperature": 0,
        "messages": [{"role": "user", "content": "What is the capital of France?"}]}
DONE = ("completed", "failed", "cancelled", "expired")


def _line(custom_id: str, body: dict, url: str = "/v1/chat/completions") -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


def _long(i: int, tokens: int) -> str:
    return _line(f"req-{i}", {"prompt": f"Story number {i}:", "max_tokens": tokens,
                              "ignore_eos": True, "temperature": 0}, "/v1/completions")


def _submit(client, lines: list[str], endpoint: str = "/v1/chat/completions", **kw):
    upload = client.files.create(file=("in.jsonl", ("\n".join(lines) + "\n").encode()),
                                 purpose="batch")
    return client.batches.create(input_file_id=upload.id, endpoint=endpoint,
                                 completion_window="24h", **kw)


def _wait(client, batch_id: str, until=lambda b: b.status in DONE, timeout: float = 300):
    deadline = time.monotonic() + timeout
    while True:
        batch = client.batches.retrieve(batch_id)
        if until(batch):
            return batch
        assert time.monotonic() < deadline, f"batch stuck: {batch}"
        time.sleep(0.2)


def _jsonl(client, file_id: str) -> list[dict]:
    return [json.loads(line) for line in client.files.content(file_id).text.splitlines()]


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return str(tmp_path_factory.mktemp("batches") / "store.sqlite")


@pytest.fixture(scope="module")
def server(store):
    s = Server("--batch-store", store, "--max-body-bytes", "4096", "--max-file-bytes",
               "65536")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server)


def test_files_are_kept_listed_read_and_deleted(client, server):
    content = b'{"a": 1}\n' * 1000  # 9,000 bytes: over --max-body-bytes, under the file cap
    made = client.files.create(file=("data.jsonl", content), purpose="user_data")
    assert (made.bytes, made.filename, made.purpose) == (len(content), "data.jsonl",
                                                        "user_data")
    assert client.files.retrieve(made.id).bytes == len(content)
    assert client.files.content(made.id).read() == content
    assert made.id in [f.id for f in client.files.list(purpose="user_data")]
    assert made.id not in [f.id for f in client.files.list(purpose="batch")]
    assert client.files.delete(made.id).deleted
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(made.id)
    with pytest.raises(openai.NotFoundError):
        client.files.delete(made.id)
    with pytest.raises(openai.APIStatusError) as too_big:
        client.files.create(file=("big.jsonl", b"x" * 70000), purpose="batch")
    assert too_big.value.status_code == 413
    with pytest.raises(openai.BadRequestError, match="purpose"):
        client.files.create(file=("x.jsonl", b"{}"), purpose="nonsense")
    r = httpx.post(server.url + "/v1/chat/completions", json={**CHAT, "x": "y" * 5000})
    assert r.status_code == 413  # other bodies keep --max-body-bytes


def test_files_expire_as_asked(client, server):
    batch_file = client.files.create(file=("in.jsonl", b"{}"), purpose="batch")
    assert batch_file.expires_at - batch_file.created_at == 30 * 86400  # --batch-file-days
    hour = client.files.create(file=("in.jsonl", b"{}"), purpose="user_data",
                               expires_after={"anchor": "created_at", "seconds": 3600})
    assert hour.expires_at - hour.created_at == 3600
    for bad, param in (({"anchor": "created_at", "seconds": 60}, "expires_after.seconds"),
                       ({"anchor": "last_used", "seconds": 3600}, "expires_after.anchor")):
        with pytest.raises(openai.BadRequestError) as refused:
            client.files.create(file=("in.jsonl", b"{}"), purpose="batch", expires_after=bad)
        assert refused.value.body["param"] == param
    batch = _submit(client, [_line("chat", CHAT)],
                    output_expires_after={"anchor": "created_at", "seconds": 7200})
    out = client.files.retrieve(_wait(client, batch.id).output_file_id)
    assert out.expires_at - out.created_at == 7200


def test_a_batch_answers_good_lines_as_the_live_api_and_bad_ones_in_the_error_file(client):
    lines = [_line("chat", CHAT),
             _line("chat-2", {**CHAT, "max_tokens": 3}),
             _line("empty", {"messages": []}),
             _line("elsewhere", {"input": "hi"}, "/v1/embeddings"),
             "not json"]
    batch = _submit(client, lines, metadata={"job": "nightly"})
    assert batch.status == "validating" and batch.metadata == {"job": "nightly"}
    done = _wait(client, batch.id)
    assert done.status == "completed" and done.completed_at >= done.created_at
    counts = done.request_counts
    assert (counts.total, counts.completed, counts.failed) == (5, 2, 3)
    good = _jsonl(client, done.output_file_id)
    assert [o["custom_id"] for o in good] == ["chat", "chat-2"]
    live = client.chat.completions.create(model="smollm2-135m", **CHAT)
    body = good[0]["response"]["body"]
    assert body["choices"][0]["message"]["content"] == live.choices[0].message.content
    assert body["usage"]["completion_tokens"] == live.usage.completion_tokens
    bad = _jsonl(client, done.error_file_id)
    assert [o["custom_id"] for o in bad] == ["empty", "elsewhere", None]
    assert "messages" in bad[0]["error"]["message"]
    assert "url must be /v1/chat/completions" in bad[1]["error"]["message"]
    assert bad[2]["error"]["message"].startswith("line 5: not JSON")
    out = client.files.retrieve(done.output_file_id)
    assert out.purpose == "batch_output"
    assert out.expires_at - out.created_at == 30 * 86400  # --batch-file-days
    assert batch.id in [b.id for b in client.batches.list()]
    with pytest.raises(openai.ConflictError):
        client.batches.cancel(batch.id)


def test_a_batch_is_refused_what_it_cannot_run(client):
    with pytest.raises(openai.NotFoundError):
        client.batches.create(input_file_id="file-none", endpoint="/v1/chat/completions",
                              completion_window="24h")
    with pytest.raises(openai.NotFoundError):
        client.batches.retrieve("batch_none")
    data = client.files.create(file=("d.jsonl", _line("a", CHAT).encode()), purpose="user_data")
    with pytest.raises(openai.BadRequestError, match="purpose 'batch'"):
        client.batches.create(input_file_id=data.id, endpoint="/v1/chat/completions",
                              completion_window="24h")
    empty = client.files.create(file=("e.jsonl", b"\n\n"), purpose="batch")
    with pytest.raises(openai.BadRequestError, match="holds 0 requests"):
        client.batches.create(input_file_id=empty.id, endpoint="/v1/chat/completions",
                              completion_window="24h")
    with pytest.raises(openai.BadRequestError, match="endpoint"):
        client.batches.create(input_file_id=empty.id, endpoint="/v1/files",
                              completion_window="24h")


def test_a_cancelled_batch_keeps_the_answers_it_has(client):
    batch = _submit(client, [_long(i, 64) for i in range(30)], "/v1/completions")
    _wait(client, batch.id, lambda b: b.request_counts.completed >= 1)
    assert client.batches.cancel(batch.id).status == "cancelling"
    done = _wait(client, batch.id)
    assert done.status == "cancelled" and done.cancelled_at is not None
    kept = _jsonl(client, done.output_file_id)
    assert 1 <= len(kept) == done.request_counts.completed < 30
    assert len({o["custom_id"] for o in kept}) == len(kept)
    assert all(o["response"]["body"]["usage"]["completion_tokens"] == 64 for o in kept)


def test_a_live_stream_is_answered_while_a_batch_runs(client):
    batch = _submit(client, [_long(i, 48) for i in range(24)], "/v1/completions")
    _wait(client, batch.id, lambda b: b.status == "in_progress")
    stream = client.chat.completions.create(model="smollm2-135m", stream=True, **CHAT)
    first = next(c for c in stream if c.choices and c.choices[0].delta.content)
    assert first.choices[0].delta.content
    at_first_token = client.batches.retrieve(batch.id)
    assert at_first_token.status == "in_progress"  # the stream did not wait for the batch
    assert at_first_token.request_counts.completed < 24
    for _ in stream:
        pass
    assert _wait(client, batch.id).request_counts.completed == 24


def test_a_server_killed_mid_batch_resumes_and_answers_every_line_once(tmp_path):
    path = str(tmp_path / "store.sqlite")
    flags = ("--batch-store", path, "--batch-concurrency", "2")
    first = Server(*flags)
    try:
        client = openai_client(first)
        batch = _submit(client, [_long(i, 32) for i in range(12)], "/v1/completions")
        _wait(client, batch.id, lambda b: b.request_counts.completed >= 2)
    finally:
        os.killpg(first.proc.pid, signal.SIGKILL)  # no shutdown: lines in flight are lost
        first.proc.wait()
    at_kill = BatchStore(path).batch(batch.id)
    assert at_kill["status"] == "in_progress" and at_kill["request_counts"]["completed"] < 12
    second = Server(*flags)
    try:
        client = openai_client(second)
        done = _wait(client, batch.id)
        assert done.status == "completed" and done.request_counts.completed == 12
        ids = [o["custom_id"] for o in _jsonl(client, done.output_file_id)]
        assert ids == [f"req-{i}" for i in range(12)]  # each once, in the input's order
        assert done.error_file_id is None
    finally:
        second.stop()


def test_two_servers_on_one_store_run_a_batch_once(tmp_path):
    """Only the server holding the store's lock works through it; the other serves the
    routes (and takes over when the first is gone)."""
    path = str(tmp_path / "store.sqlite")
    servers = [Server("--batch-store", path), Server("--batch-store", path)]
    try:
        clients = [openai_client(s) for s in servers]
        batch = _submit(clients[1], [_long(i, 8) for i in range(6)], "/v1/completions")
        done = _wait(clients[0], batch.id)
        assert done.request_counts.completed == 6
        assert len(_jsonl(clients[0], done.output_file_id)) == 6
        assert sum(finished(s) for s in servers) == 6  # not 12: one server ran them
    finally:
        for s in servers:
            s.stop()


def test_an_embeddings_batch_answers_as_the_live_api(client):
    texts = ["The tide comes in.", "The tide goes out."]
    batch = _submit(client, [_line(f"e{i}", {"input": t}, "/v1/embeddings")
                             for i, t in enumerate(texts)], "/v1/embeddings")
    done = _wait(client, batch.id)
    assert done.request_counts.completed == 2
    out = _jsonl(client, done.output_file_id)
    live = client.embeddings.create(model="smollm2-135m", input=texts[1])
    vector = out[1]["response"]["body"]["data"][0]["embedding"]
    # the batch's prompts and the live one are computed in other steps: float32 sums of the
    # projections in another grouping (observed up to 1.5e-5)
    assert vector == pytest.approx(live.data[0].embedding, abs=1e-4)
