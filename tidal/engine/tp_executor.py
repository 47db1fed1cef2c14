"""`TensorParallelExecutor`: the model split across `tensor_parallel_size` workers, each a
torch.distributed rank on this machine (tidal.model.tensor_parallel). Rank 0 lives in the
engine core's process; the others are child processes that mirror each of its calls:
the executor sends a call to every other rank, makes it on rank 0, then waits for their
replies. Every rank runs every step (their all-reduces meet inside the forward pass) and
samples the same tokens; rank 0's are the step's. The scheduler is unchanged: each rank
holds its heads' share of every KV block under the same block tables."""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import threading
from multiprocessing.connection import Client, Connection, Listener
from pathlib import Path

from tidal.core import ModelOutput, SamplingParams, SchedulerOutput
from tidal.engine.config import EngineConfig
from tidal.engine.executor import ExecutorDead
from tidal.engine.worker import Worker
from tidal.model.config import ModelArch
from tidal.model.tensor_parallel import TPGroup, check_shardable

log = logging.getLogger("tidal.engine")


class RankFailed(ExecutorDead):
    """A rank raised while making a call (its message), is gone, or did not answer: the
    ranks may have left their collectives at different points, so the group is done."""


class TensorParallelExecutor:
    """Workers on `config.parallel.tensor_parallel_size` ranks: rank 0 here, the others in
    child processes, which exit when this process does (their connection closes)."""

    def __init__(self, config: EngineConfig, folder: str | Path) -> None:
        size = config.parallel.tensor_parallel_size
        check_shardable(ModelArch.from_folder(folder), size)  # before any process starts
        self.timeout = timeout = config.parallel.distributed_timeout
        # The group meets at a file store (the ranks share this machine): no port to pick.
        self._store = tempfile.mkdtemp(prefix="tidal-tp-")
        store = os.path.join(self._store, "store")
        authkey = secrets.token_bytes(16)
        self.conns, self.procs, self.group = [], [], None
        with Listener(("127.0.0.1", 0), authkey=authkey) as listener:
            try:
                # Plain child processes: an engine core is a daemonic process, which
                # multiprocessing forbids children of its own.
                for _ in range(1, size):
                    proc = subprocess.Popen([sys.executable, "-m", "tidal.engine.tp_executor",
                                             *map(str, listener.address)],
                                            stdin=subprocess.PIPE)
                    self.procs.append(proc)
                    proc.stdin.write(authkey)
                    proc.stdin.close()
                self.conns = _accept(listener, self.procs)
                for rank, conn in enumerate(self.conns, 1):
                    conn.send((rank, size, store, config, str(folder)))
                self.group = TPGroup.join(0, size, store, timeout)
                self.worker = Worker.from_config(config, folder, tp=self.group)
                self._replies(patient=True)  # a load takes what it takes; a crash closes the pipe
            except BaseException:
                self.close()
                raise
        self.info = self.worker.info
        log.info("tensor parallel: %d ranks, %d KV blocks each", size, self.info.num_blocks)

    def _call(self, method: str, *args):
        """`method(*args)` on every rank's worker; rank 0's result."""
        for rank, conn in enumerate(self.conns, 1):
            try:
                conn.send((method, args))
            except OSError:  # a rank that died: the group cannot compute any more
                raise RankFailed(f"tensor-parallel rank {rank}: the process is gone") from None
        failure = None
        try:
            result = getattr(self.worker, method)(*args)
        except Exception as exc:
            failure = f"rank 0: {type(exc).__name__}: {exc}"
        self._replies(failure)
        return result

    def _replies(self, failure: str | None = None, patient: bool = False) -> None:
        """Wait for every other rank's reply, at most the collectives' timeout and a margin
        (`patient`: as long as it takes); raise RankFailed with every failure, `failure`
        (rank 0's) first."""
        wait = None if patient else self.timeout + 10
        failures = [failure] if failure else []
        for rank, conn in enumerate(self.conns, 1):
            try:
                reply = conn.recv() if conn.poll(wait) else f"no answer in {wait:g} s"
            except (EOFError, OSError):
                reply = "the process is gone"
            if reply is not None:
                failures.append(f"rank {rank}: {reply}")
        if failures:
            raise RankFailed("tensor-parallel " + "; ".join(failures))

    def execute(self, out: SchedulerOutput) -> ModelOutput:
        return self._call("execute", out)

    def forget(self, rid: str, finished: bool = False) -> None:
        self._call("forget", rid, finished)

    def compile_constraint(self, params: SamplingParams) -> None:
        # From the compiler thread: rank 0 only (the pipes belong to the step loop); the
        # other ranks compile a constraint when its request first reaches them.
        self.worker.compile_constraint(params)

    def read_blocks(self, block_ids: list[int]) -> tuple[bytes, list[int], str]:
        raise ValueError("P/D KV transfer does not run tensor-parallel ranks yet")

    def write_blocks(self, block_ids: list[int], data: bytes, shape: list[int],
                     dtype: str) -> None:
        raise ValueError("P/D KV transfer does not run tensor-parallel ranks yet")

    def touch_kv_cache(self, block_ids: list[int]) -> None:
        self._call("touch_kv_cache", block_ids)

    def adapters(self) -> dict[str, str] | None:
        return None  # LoRA is refused with tensor parallelism (EngineConfig)

    def register_adapter(self, name: str, path: str) -> None:
        raise ValueError("LoRA adapters do not split across tensor-parallel ranks yet")

    def unregister_adapter(self, name: str) -> None:
        raise ValueError("LoRA adapters do not split across tensor-parallel ranks yet")

    def load_adapter(self, name: str) -> None:
        raise ValueError("LoRA adapters do not split across tensor-parallel ranks yet")

    def close(self) -> None:
        """Stop the other ranks (and leave the group)."""
        for conn in self.conns:
            try:
                conn.send(None)
            except OSError:
                pass
        for proc in self.procs:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.conns, self.procs = [], []
        (self.group or TPGroup(0, 1)).close()  # this process may start another group later
        shutil.rmtree(self._store, ignore_errors=True)


def _accept(listener: Listener, procs: list[subprocess.Popen]) -> list[Connection]:
    """The other ranks' connections, in the order they came (each is then told its rank):
    as long as their processes start, which may take a while on a busy machine; a process
    that exits first fails the group."""
    conns: list[Connection] = []
    accepting = threading.Thread(target=lambda: conns.extend(
        listener.accept() for _ in procs), daemon=True)
    accepting.start()
    while accepting.is_alive():
        accepting.join(0.2)
        if any(p.poll() is not None for p in procs):
            raise RankFailed(f"tensor-parallel ranks: {len(conns)} of {len(procs)} connected "
                             f"before a rank's process exited")
    return conns


def rank_main(host: str, port: int, authkey: bytes) -> None:
    """A rank's process: take its place from rank 0, build its worker, then make each call
    rank 0 sends until told to stop (None) or rank 0 is gone; reply None, or what went
    wrong."""
    conn = Client((host, port), authkey=authkey)
    try:
        rank, size, store, config, folder = conn.recv()
        logging.basicConfig(level=logging.WARNING,
                            format=f"%(asctime)s tp-rank-{rank} %(name)s: %(message)s")
        group = TPGroup.join(rank, size, store, config.parallel.distributed_timeout)
        worker = Worker.from_config(config, folder, tp=group)
        conn.send(None)
    except Exception as exc:
        conn.send(f"{type(exc).__name__}: {exc}")
        return
    while True:
        try:
            call = conn.recv()
        except (EOFError, OSError):
            return  # rank 0's process is gone
        if call is None:
            return
        method, args = call
        try:
            getattr(worker, method)(*args)
            conn.send(None)
        except Exception as exc:
            conn.send(f"{type(exc).__name__}: {exc}")


if __name__ == "__main__":  # a rank: `python -m tidal.engine.tp_executor HOST PORT`, key on stdin
    rank_main(sys.argv[1], int(sys.argv[2]), sys.stdin.buffer.read())
