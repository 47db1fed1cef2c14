"""The disk tier of the prefix cache: one file per KV block, named by the block's tier key
(`tidal.core.kv_tiers.tier_key`) in a folder of its own per model, dtype and block layout,
so a restarted server and the other engine cores of this machine find them. Files are
written by a thread, atomically (a temporary name, then rename), and each carries a
CRC-32 of its KV: a truncated or corrupt file is found on reading, deleted and never served. The
folder keeps within its size, least recently written first. The writer thread rescans the
folder when it changed (at most once a second), so blocks another engine core of this
machine wrote, or deleted, since this one started reach this core's index (`news`)."""

from __future__ import annotations

import hashlib
import logging
import os
import queue
import threading
import time
import zlib
from collections import OrderedDict
from pathlib import Path

import torch

from tidal.core.kv_tiers import TierReport

log = logging.getLogger("tidal.engine")

MAGIC = b"TKV2"  # TKV1's files (a BLAKE2b checksum) read as corrupt: deleted, recomputed
KEY_BYTES, SUM_BYTES = 16, 4
HEADER = len(MAGIC) + KEY_BYTES + 8 + SUM_BYTES  # magic, key, payload length, checksum
RESCAN_SECONDS = 1.0  # a listing of the folder costs ~1 ms per 1,000 blocks


def tier_folder(root: str | os.PathLike, identity: dict) -> Path:
    """The folder of one model's blocks under `root`: a digest of what makes its KV bytes
    (the model's files, dtype, block shape)."""
    digest = hashlib.sha256(repr(sorted(identity.items())).encode()).hexdigest()[:20]
    return Path(root).expanduser() / digest


def _checksum(data) -> bytes:
    """A CRC-32 of a block's bytes (5x faster than BLAKE2b here, ~0.07 ms for 360 KiB): it
    finds truncation and corruption, which is all it is for."""
    return zlib.crc32(data).to_bytes(SUM_BYTES, "little")


class DiskKVTier:
    """Block files of `block_bytes` each under `folder`, at most `capacity_bytes` of them
    (files and headers). `store` returns at once (a thread writes); `load_into` reads a
    block back into a row of memory, or reports it missing, truncated or corrupt (that file
    is deleted)."""

    def __init__(self, folder: Path, block_bytes: int, capacity_bytes: int) -> None:
        self.folder, self.block_bytes = folder, block_bytes
        self.capacity = max(0, capacity_bytes // (block_bytes + HEADER))  # blocks
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ValueError(f"--kv-cache-dir: cannot make the disk tier's folder "
                             f"{folder}: {e.strerror or e}") from None
        self._listed = _mtime(folder)  # the folder's change time at its last listing
        found = sorted(folder.glob("*.kv"), key=_mtime)  # oldest first
        self._files: OrderedDict[bytes, None] = OrderedDict()  # only the writer changes it
        for path in found:
            key = _key(path.name)
            if key is not None:
                self._files[key] = None
        self._trim()
        self._lock = threading.Lock()
        self._pending: dict[bytes, bytes] = {}  # stored, not yet written: loads read these
        self._news: dict[bytes, bool] = {}  # others' blocks found (True) or gone (False)
        self._next_scan = time.monotonic() + RESCAN_SECONDS
        self._queue: queue.Queue[bytes | None] = queue.Queue()
        self.written = self.load_failures = 0
        self._writer = threading.Thread(target=self._write_loop, name="tidal-kv-disk",
                                        daemon=True)
        self._writer.start()
        log.info("KV disk tier: %d blocks of %.1f KiB found in %s (room for %d)",
                 len(self._files), block_bytes / 1024, folder, self.capacity)

    def keys(self) -> list[bytes]:
        """The blocks on disk, least recently written first."""
        return list(self._files)

    def knows(self, key: bytes) -> bool:
        """Whether the block is on disk, as of this tier's last write or listing."""
        return key in self._files

    def report(self) -> TierReport:
        """Blocks other processes wrote (True) or deleted (False) on this folder since the
        last call, found by the writer thread's listings."""
        with self._lock:
            news, self._news = self._news, {}
        return TierReport(news)

    def store(self, key: bytes, data: bytes) -> None:
        with self._lock:
            self._pending[key] = data
        self._queue.put(key)

    def load_into(self, key: bytes, out: torch.Tensor) -> bool:
        """Read the block into `out` (block_bytes of uint8 in host memory, contiguous): the
        file's payload straight into it, no copy between. False if it is missing,
        truncated or corrupt (`out` then holds anything)."""
        with self._lock:
            data = self._pending.get(key)
        if data is not None:
            out.numpy()[:] = memoryview(data)  # one copy
            return True
        path, view = self._path(key), out.numpy()
        try:
            with open(path, "rb", buffering=0) as f:
                head, got, extra = f.read(HEADER), f.readinto(view), f.read(1)
        except OSError:
            return False
        if (len(head) != HEADER or got != self.block_bytes or extra or head[:4] != MAGIC
                or head[4:4 + KEY_BYTES] != key
                or int.from_bytes(head[4 + KEY_BYTES:12 + KEY_BYTES], "little")
                != self.block_bytes
                or head[12 + KEY_BYTES:] != _checksum(view)):
            self.load_failures += 1
            log.warning("KV disk tier: %s is truncated or corrupt; deleted", path.name)
            path.unlink(missing_ok=True)
            return False
        return True

    def close(self) -> None:
        """Write what is pending, then stop the writer."""
        self._queue.put(None)
        self._writer.join()

    def _path(self, key: bytes) -> Path:
        return self.folder / f"{key.hex()}.kv"

    def _write_loop(self) -> None:
        while True:
            try:
                key = self._queue.get(timeout=RESCAN_SECONDS)
            except queue.Empty:
                key = b""  # idle: a listing may be due
            if key is None:
                return
            if time.monotonic() >= self._next_scan:
                self._rescan()
            with self._lock:
                data = self._pending.get(key)
            if data is None:
                continue
            try:
                self._write(key, data)
            except OSError as e:  # a full disk: this block stays uncached, serving goes on
                log.warning("KV disk tier: could not write a block: %s", e)
            with self._lock:
                self._pending.pop(key, None)

    def _rescan(self) -> None:
        """List the folder if it changed since the last listing: blocks other processes
        wrote join this tier (newest), those they deleted leave it, and both are news."""
        self._next_scan = time.monotonic() + RESCAN_SECONDS
        changed = _mtime(self.folder)  # read before listing: a later change shows next time
        if changed == self._listed:
            return
        self._listed = changed
        try:
            on_disk = {k for e in os.scandir(self.folder) if (k := _key(e.name)) is not None}
        except OSError:
            return
        news = {k: False for k in self._files if k not in on_disk}
        for key in news:
            del self._files[key]
        for key in on_disk.difference(self._files):
            self._files[key] = None
            news[key] = True
        for key in self._trim():
            news[key] = False
        if news:
            with self._lock:
                self._news.update(news)

    def _write(self, key: bytes, data: bytes) -> None:
        if len(data) != self.block_bytes:
            raise OSError(f"a block of {len(data)} bytes, not {self.block_bytes}")
        path = self._path(key)
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        with open(tmp, "wb") as f:
            f.write(MAGIC + key + len(data).to_bytes(8, "little") + _checksum(data))
            f.write(data)
        tmp.replace(path)  # whole or absent: a reader never sees half a file
        self._files[key] = None
        self._files.move_to_end(key)
        self.written += 1
        self._trim()

    def _trim(self) -> list[bytes]:
        """Delete the least recently written blocks past the capacity; their keys."""
        gone = []
        while len(self._files) > self.capacity:
            old, _ = self._files.popitem(last=False)
            self._path(old).unlink(missing_ok=True)
            gone.append(old)
        return gone


def _key(name: str) -> bytes | None:
    """The key of a block file's name (None: a temporary file, or not one of ours)."""
    if name.startswith(".") or not name.endswith(".kv"):
        return None
    try:
        key = bytes.fromhex(name[:-3])
    except ValueError:
        return None
    return key if len(key) == KEY_BYTES else None


def _mtime(path: Path) -> int:
    try:
        return path.stat().st_mtime_ns
    except OSError:
        return 0
