"""The Batch API's store and its runner's pacing, without a server: a line is answered once;
a batch ends with its output and error files in the input's order (an expired one with its
unanswered lines as errors) and drops its lines; files expire; pages of a listing; and the
runner starts at most one line while live requests are in flight."""

from __future__ import annotations

import asyncio
import json
import sqlite3
import time
from pathlib import Path

from hypothesis import given, strategies as st

from tidal.server.batches.lines import output
from tidal.server.batches.runner import EXPIRED, BatchRunner
from tidal.server.batches.store import BatchStore, _page


def _batch(store: BatchStore, n: int, window: int = 3600, **body) -> dict:
    lines = [json.dumps({"custom_id": f"c{i}", "url": "/v1/completions", "body": {}})
             for i in range(1, n + 1)]
    return store.add_batch({"endpoint": "/v1/completions", "input_file_id": "file-x",
                            "completion_window": "24h", "metadata": None, **body}, lines,
                           window)


def _content(store: BatchStore, file_id: str) -> list[dict]:
    return [json.loads(line) for line in store.content(file_id).decode().splitlines()]


def test_a_line_is_answered_once_and_the_files_keep_the_input_order(tmp_path):
    store = BatchStore(tmp_path / "s.sqlite")
    batch = _batch(store, 4)
    assert batch["status"] == "validating" and batch["request_counts"]["total"] == 4
    for number in (3, 1, 2):  # out of order, as concurrent lines come back
        status = 500 if number == 2 else 200
        assert store.answer(batch["id"], number, output(f"c{number}", status, None, {}))
    assert not store.answer(batch["id"], 1, output("again", 200, None, {}))
    assert [n for n, _ in store.unanswered(batch["id"])] == [4]
    assert store.batch(batch["id"])["request_counts"] == {"total": 4, "completed": 2,
                                                          "failed": 1}
    done = store.finish(batch["id"], "completed")
    assert done["status"] == "completed" and done["completed_at"] is not None
    assert [o["custom_id"] for o in _content(store, done["output_file_id"])] == ["c1", "c3"]
    assert [o["custom_id"] for o in _content(store, done["error_file_id"])] == ["c2"]
    assert store.finish(batch["id"], "completed") is None  # ended once
    assert store.next_active() is None


def test_an_expired_batch_writes_its_unanswered_lines_as_errors(tmp_path):
    store = BatchStore(tmp_path / "s.sqlite")
    batch = _batch(store, 3)
    store.answer(batch["id"], 2, output("c2", 200, None, {}))
    done = store.finish(batch["id"], "expired", EXPIRED)
    errors = _content(store, done["error_file_id"])
    assert [o["custom_id"] for o in errors] == ["c1", "c3"]
    assert all(o["error"]["code"] == "batch_expired" and o["response"] is None
               for o in errors)
    assert done["expired_at"] is not None


def test_a_store_reopened_holds_what_was_written(tmp_path):
    path = tmp_path / "s.sqlite"
    store = BatchStore(path)
    made = store.add_file(b"abc", "a.jsonl", "batch")
    batch = _batch(store, 2)
    store.answer(batch["id"], 1, output("c1", 200, None, {}))
    store.close()
    again = BatchStore(path)
    assert again.content(made["id"]) == b"abc"
    assert again.next_active()["id"] == batch["id"]
    assert [n for n, _ in again.unanswered(batch["id"])] == [2]


@given(st.integers(0, 30), st.integers(1, 10), st.integers(-1, 31))
def test_pages_walk_a_listing_once(n, limit, cursor):
    items = [{"id": f"i{k}"} for k in range(n)]
    seen, after, more = [], None, True
    while more:
        page, more = _page(items, limit, after)
        assert len(page) <= limit
        seen += page
        after = page[-1]["id"] if page else None
        if not page:
            break
    assert seen == items
    after = f"i{cursor}"
    page, _ = _page(items, limit, after)
    assert page == items[cursor + 1:cursor + 1 + limit] if 0 <= cursor < n else page == []


class _Frontend:
    live = 0

    def live_sequences(self) -> int:
        return self.live


def test_the_runner_starts_one_line_at_a_time_while_live_requests_run(tmp_path):
    async def main():
        frontend = _Frontend()
        runner = BatchRunner(frontend, None, Path(tmp_path / "s.sqlite"), concurrency=4)
        batch = _batch(runner.store(), 1)

        async def room(running: int, wait: float) -> bool:
            try:
                await asyncio.wait_for(runner._room(batch, set(range(running))), wait)
                return True
            except asyncio.TimeoutError:
                return False

        # room is found at once, so a loaded machine gets long to show it; no room never comes
        assert await room(3, 30.0) and not await room(4, 0.3)
        frontend.live = 2
        assert await room(0, 30.0) and not await room(1, 0.3)
        runner.store().set_status(batch["id"], "cancelling")
        assert await runner._room(batch, {1, 2}) == "cancelled"

    asyncio.run(main())


def test_an_expired_file_is_gone_and_purged(tmp_path, monkeypatch):
    store = BatchStore(tmp_path / "s.sqlite")
    now = time.time()
    kept = store.add_file(b"keep", "k.jsonl", "batch", int(now) + 3600)
    gone = store.add_file(b"gone", "g.jsonl", "batch", int(now) - 1)
    forever = store.add_file(b"ever", "e.jsonl", "user_data")
    assert kept["expires_at"] == int(now) + 3600 and forever["expires_at"] is None
    assert store.file(gone["id"]) is None and store.content(gone["id"]) is None
    assert not store.delete_file(gone["id"])
    assert [f["id"] for f in store.files(None, 10, None, False)[0]] == [kept["id"],
                                                                      forever["id"]]
    assert store.purge() == 1  # the row itself is deleted
    assert store._run("SELECT COUNT(*) FROM files")[0][0] == 2


def test_a_finished_batch_drops_its_lines_and_keeps_its_counts(tmp_path):
    store = BatchStore(tmp_path / "s.sqlite")
    batch = _batch(store, 3, output_expires_after={"anchor": "created_at", "seconds": 7200})
    store.answer(batch["id"], 1, output("c1", 200, None, {}))
    store.answer(batch["id"], 2, output("c2", 500, None, {}))
    done = store.finish(batch["id"], "cancelled")
    counts = {"total": 3, "completed": 1, "failed": 1}
    assert done["request_counts"] == counts == store.batch(batch["id"])["request_counts"]
    assert store._run("SELECT COUNT(*) FROM lines")[0][0] == 0
    out = store.file(done["output_file_id"])
    assert out["expires_at"] - out["created_at"] == 7200


def test_a_store_made_before_files_expired_is_opened(tmp_path):
    path = tmp_path / "old.sqlite"
    db = sqlite3.connect(path)
    db.executescript("CREATE TABLE files (id TEXT PRIMARY KEY, created_at INTEGER, "
                     "purpose TEXT, filename TEXT, bytes INTEGER, content BLOB);"
                     "INSERT INTO files VALUES ('file-old', 1, 'batch', 'a', 3, X'616263');")
    db.close()
    store = BatchStore(path)
    assert store.file("file-old")["expires_at"] is None
    assert store.content("file-old") == b"abc"
