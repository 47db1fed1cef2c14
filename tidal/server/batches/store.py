"""The Batch API's persistent store: files (uploads and the batches' output and error files)
and batches, each batch with its input lines and each line's answer once it has one, in one
SQLite file. A line's answer is written when it comes back, so a server killed mid-batch
resumes with the lines that have none; a batch's output files are written in the same
transaction that finishes it, which also drops its lines (the counts stay in its object).
A file may expire (`expires_at`): it is gone from then on, and `purge` deletes it. Every
method is blocking: the routes call them in a thread."""

from __future__ import annotations

import json
import sqlite3
import threading
import time
import uuid
from contextlib import contextmanager
from pathlib import Path

from tidal.server.batches.lines import custom_id_of, refused

# a batch's object is its `body`; `status` repeats the body's, for the query of next_active
SCHEMA = """
CREATE TABLE IF NOT EXISTS files (id TEXT PRIMARY KEY, created_at INTEGER, purpose TEXT,
    filename TEXT, bytes INTEGER, content BLOB, expires_at INTEGER);
CREATE TABLE IF NOT EXISTS batches (id TEXT PRIMARY KEY, status TEXT, body TEXT);
CREATE TABLE IF NOT EXISTS lines (batch_id TEXT, number INTEGER, text TEXT, output TEXT,
    failed INTEGER, PRIMARY KEY (batch_id, number));
"""
ACTIVE = ("validating", "in_progress", "finalizing", "cancelling")
"""Statuses of a batch the runner still has work for."""
LIST_LIMIT = 10000
FILE_COLUMNS = "id, created_at, purpose, filename, bytes, expires_at"
LIVE = "(expires_at IS NULL OR expires_at > CAST(strftime('%s', 'now') AS INTEGER))"
"""The files that have not expired."""


class BatchStore:
    """Files and batches in the SQLite file at `path` (made on first use); safe to share
    between this process's threads, and between processes (SQLite's own locking)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(self.path, check_same_thread=False, timeout=30,
                                   isolation_level=None)
        self._lock = threading.Lock()
        with self._lock:
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.executescript(SCHEMA)
            columns = [row[1] for row in self._db.execute("PRAGMA table_info(files)")]
            if "expires_at" not in columns:  # a store made before files could expire
                try:
                    self._db.execute("ALTER TABLE files ADD COLUMN expires_at INTEGER")
                except sqlite3.OperationalError:  # unless another server added it first
                    if "expires_at" not in [row[1] for row in
                                            self._db.execute("PRAGMA table_info(files)")]:
                        raise

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def _run(self, sql: str, args: tuple = ()) -> list[tuple]:
        with self._lock:
            return self._db.execute(sql, args).fetchall()

    @contextmanager
    def _transaction(self):
        """This process's lock, and a write transaction other processes wait for."""
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    # ------------------------------------------------------------------ files
    def add_file(self, content: bytes, filename: str, purpose: str,
                 expires_at: int | None = None) -> dict:
        """Keep a file (until `expires_at`, a Unix time; None: until deleted); its OpenAI
        file object."""
        with self._lock:
            return _insert_file(self._db, content, filename, purpose, expires_at)

    def file(self, file_id: str) -> dict | None:
        rows = self._run(f"SELECT {FILE_COLUMNS} FROM files WHERE id = ? AND {LIVE}",
                         (file_id,))
        return _file(*rows[0]) if rows else None

    def files(self, purpose: str | None, limit: int, after: str | None,
              newest_first: bool) -> tuple[list[dict], bool]:
        """A page of file objects, and whether more follow it."""
        rows = self._run(f"SELECT {FILE_COLUMNS} FROM files WHERE (? IS NULL OR purpose = ?) "
                         f"AND {LIVE} ORDER BY rowid " + ("DESC" if newest_first else "ASC"),
                         (purpose, purpose))
        return _page([_file(*r) for r in rows], limit, after)

    def content(self, file_id: str) -> bytes | None:
        rows = self._run(f"SELECT content FROM files WHERE id = ? AND {LIVE}", (file_id,))
        return bytes(rows[0][0]) if rows else None

    def delete_file(self, file_id: str) -> bool:
        with self._lock:
            return self._db.execute(f"DELETE FROM files WHERE id = ? AND {LIVE}",
                                    (file_id,)).rowcount > 0

    def purge(self) -> int:
        """Delete the files that have expired; how many."""
        with self._lock:
            return self._db.execute(f"DELETE FROM files WHERE NOT {LIVE}").rowcount

    # ---------------------------------------------------------------- batches
    def add_batch(self, body: dict, lines: list[str], window: int) -> dict:
        """Keep a new batch (`body`: its object less id, status and timestamps) with its
        input lines, numbered from 1, to be done within `window` seconds; its object, in
        status `validating`."""
        now = int(time.time())
        batch = {"id": f"batch_{uuid.uuid4().hex[:24]}", "object": "batch", **body,
                 "errors": None, "status": "validating", "output_file_id": None,
                 "error_file_id": None, "created_at": now, "in_progress_at": None,
                 "expires_at": now + window, "finalizing_at": None,
                 "completed_at": None, "failed_at": None, "expired_at": None,
                 "cancelling_at": None, "cancelled_at": None}
        with self._transaction() as db:
            db.execute("INSERT INTO batches VALUES (?, ?, ?)",
                       (batch["id"], "validating", json.dumps(batch)))
            db.executemany("INSERT INTO lines VALUES (?, ?, ?, NULL, 0)",
                           [(batch["id"], n, text) for n, text in enumerate(lines, 1)])
        return self._counted(batch)

    def batch(self, batch_id: str) -> dict | None:
        rows = self._run("SELECT body FROM batches WHERE id = ?", (batch_id,))
        return self._counted(json.loads(rows[0][0])) if rows else None

    def batches(self, limit: int, after: str | None) -> tuple[list[dict], bool]:
        """A page of batch objects, newest first, and whether more follow it."""
        rows = self._run("SELECT body FROM batches ORDER BY rowid DESC")
        page, more = _page([json.loads(r[0]) for r in rows], limit, after)
        return [self._counted(b) for b in page], more

    def next_active(self) -> dict | None:
        """The oldest batch with work left."""
        rows = self._run(f"SELECT body FROM batches WHERE status IN "
                         f"({', '.join('?' * len(ACTIVE))}) ORDER BY rowid LIMIT 1", ACTIVE)
        return self._counted(json.loads(rows[0][0])) if rows else None

    def set_status(self, batch_id: str, status: str, only_from: tuple[str, ...] = ACTIVE
                   ) -> dict | None:
        """Move a batch to `status` (stamping `<status>_at`) if it is in one of `only_from`;
        its object after, or None if it was not moved."""
        with self._transaction():
            batch = self._move(batch_id, status, only_from)
        return None if batch is None else self._counted(batch)

    def _move(self, batch_id: str, status: str, only_from: tuple[str, ...]) -> dict | None:
        rows = self._db.execute("SELECT body FROM batches WHERE id = ?", (batch_id,)).fetchall()
        batch = json.loads(rows[0][0]) if rows else None
        if batch is None or batch["status"] not in only_from:
            return None
        batch["status"] = status
        batch[f"{status}_at"] = int(time.time())
        self._db.execute("UPDATE batches SET status = ?, body = ? WHERE id = ?",
                         (status, json.dumps(batch), batch_id))
        return batch

    def unanswered(self, batch_id: str) -> list[tuple[int, str]]:
        """(number, text) of the lines without an answer, in order."""
        return self._run("SELECT number, text FROM lines WHERE batch_id = ? AND output IS "
                         "NULL ORDER BY number", (batch_id,))

    def answer(self, batch_id: str, number: int, output: dict) -> bool:
        """Record a line's answer (once: False if it had one)."""
        with self._lock:
            return self._db.execute(
                "UPDATE lines SET output = ?, failed = ? WHERE batch_id = ? AND number = ? "
                "AND output IS NULL", (json.dumps(output), output["error"] is not None,
                                       batch_id, number)).rowcount > 0

    def finish(self, batch_id: str, status: str, unanswered: dict | None = None) -> dict | None:
        """End a batch in `status` (completed, cancelled or expired) with its output file
        (the answered lines) and error file (the failed ones, and with `unanswered` (an
        error) the lines without an answer), in the input's order, in one transaction that
        also drops its lines. The files expire after the batch's `output_expires_after`."""
        with self._transaction() as db:
            rows = db.execute("SELECT number, text, output, failed FROM lines WHERE "
                              "batch_id = ? ORDER BY number", (batch_id,)).fetchall()
            ok, bad = [], []
            for number, text, out, failed in rows:
                if out is not None:
                    (bad if failed else ok).append(out)
                elif unanswered is not None:
                    bad.append(json.dumps(_unanswered(text, number, unanswered)))
            batch = self._move(batch_id, status, ACTIVE)
            if batch is not None:
                keep = (batch.get("output_expires_after") or {}).get("seconds")
                expires = int(time.time()) + keep if keep else None
                for key, kept, name in (("output_file_id", ok, "output"),
                                        ("error_file_id", bad, "error")):
                    if kept:
                        batch[key] = _insert_file(db, ("\n".join(kept) + "\n").encode(),
                                                  f"{batch_id}_{name}.jsonl",
                                                  "batch_output", expires)["id"]
                batch = self._counted(batch, db)  # the counts stay; the lines go
                db.execute("UPDATE batches SET body = ? WHERE id = ?",
                           (json.dumps(batch), batch_id))
                db.execute("DELETE FROM lines WHERE batch_id = ?", (batch_id,))
        return batch

    def _counted(self, batch: dict, db: sqlite3.Connection | None = None) -> dict:
        """The batch object with its request counts as they stand (a finished batch's are
        in its object)."""
        if batch["status"] not in ACTIVE and "request_counts" in batch:
            return batch
        run = self._run if db is None else lambda *a: db.execute(*a).fetchall()
        total, done, failed = run(
            "SELECT COUNT(*), COUNT(output), COALESCE(SUM(failed), 0) FROM lines "
            "WHERE batch_id = ?", (batch["id"],))[0]
        batch["request_counts"] = {"total": total, "completed": done - failed,
                                   "failed": failed}
        return batch


def _insert_file(db: sqlite3.Connection, content: bytes, filename: str, purpose: str,
                 expires_at: int | None) -> dict:
    """Keep a file (under the caller's lock); its OpenAI file object."""
    file_id, now = f"file-{uuid.uuid4().hex[:24]}", int(time.time())
    db.execute(f"INSERT INTO files ({FILE_COLUMNS}, content) VALUES (?, ?, ?, ?, ?, ?, ?)",
               (file_id, now, purpose, filename, len(content), expires_at, content))
    return _file(file_id, now, purpose, filename, len(content), expires_at)


def _file(file_id: str, created: int, purpose: str, filename: str, size: int,
          expires_at: int | None) -> dict:
    return {"id": file_id, "object": "file", "bytes": size, "created_at": created,
            "filename": filename, "purpose": purpose, "status": "processed",
            "expires_at": expires_at}


def _page(items: list[dict], limit: int, after: str | None) -> tuple[list[dict], bool]:
    """The `limit` items after the one whose id is `after` (None: from the first; an id
    not among them: none), and whether more follow."""
    ids = [item["id"] for item in items]
    start = 0 if after is None else ids.index(after) + 1 if after in ids else len(ids)
    return items[start:start + limit], len(items) > start + limit


def _unanswered(text: str, number: int, error: dict) -> dict:
    """The error-file line of a line the batch ended without answering."""
    out = refused(custom_id_of(text), number, error["code"], error["message"])
    out["response"] = None
    return out
