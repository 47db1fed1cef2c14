"""`TensorParallelExecutor`: the model split across `tensor_parallel_size` workers, each a
torch.distributed rank on this machine or, with --nnodes, on several
(tidal.model.tensor_parallel). Rank 0 lives in the engine core's process; the others are
child processes (of the core, or of `tidal serve --headless` on other machines:
`serve_node`) that mirror each of its calls:
the executor sends a call to every other rank, makes it on rank 0, then waits for their
replies. Every rank runs every step (their all-reduces meet inside the forward pass) and
samples the same tokens; rank 0's are the step's. The scheduler is unchanged: each rank
holds its heads' share of every KV block under the same block tables."""

from __future__ import annotations

import hashlib
import logging
import os
import secrets
import signal
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client, Connection, Listener
from pathlib import Path

from tidal.core import ModelOutput, SamplingParams, SchedulerOutput
from tidal.core.kv_tiers import TierReport
from tidal.engine.config import EngineConfig
from tidal.engine.executor import ExecutorDead
from tidal.engine.kv_cache import kv_message, kv_tensor
from tidal.engine.kv_shards import KVShards
from tidal.engine.worker import Worker
from tidal.model.config import ModelArch, check_shardable, stage_layers
from tidal.model.hosts import free_port
from tidal.model.tensor_parallel import TPGroup

log = logging.getLogger("tidal.engine")


class RankFailed(ExecutorDead):
    """A rank raised while making a call (its message), is gone, or did not answer: the
    ranks may have left their collectives at different points, so the group is done."""


class TensorParallelExecutor:
    """Workers on `config.parallel.tensor_parallel_size` ranks: rank 0 here, the others of
    this machine in child processes, which exit when this process does (their connection
    closes), and with --nnodes those of the other machines, started there by
    `tidal serve --headless` (`serve_node`)."""

    def __init__(self, config: EngineConfig, folder: str | Path) -> None:
        parallel = config.parallel
        self.size = size = parallel.tensor_parallel_size
        stages, world = parallel.pipeline_parallel_size, parallel.world_size
        arch = ModelArch.from_folder(folder)
        check_shardable(arch, size, parallel.enable_expert_parallel)  # before any rank starts
        stage_layers(arch.num_layers, stages, 0)  # refuses more stages than layers
        self.shards = KVShards(size, stages, arch.num_layers, arch.num_kv_heads)
        self.timeout = timeout = parallel.distributed_timeout
        _check_own_spin(config.model.omp_spin_count)
        self._store = None  # the file store's folder, where the ranks share this machine
        ray = parallel.distributed_executor_backend == "ray"
        if parallel.nnodes > 1:  # rank 0's TCP store, and its socket on node 0's address
            init = f"tcp://{parallel.master_addr}:{parallel.master_port + 1}"
            address, authkey = (parallel.master_addr, parallel.master_port), node_key(parallel)
        elif ray:  # the actors may land on any node: this node's address
            host = _ray_node_address()
            init = f"tcp://{host}:{free_port(host)}"
            address, authkey = (host, 0), secrets.token_bytes(16)
        else:  # the ranks share this machine: a file store, no port to pick
            self._store = tempfile.mkdtemp(prefix="tidal-tp-")
            init = "file://" + os.path.join(self._store, "store")
            address, authkey = ("127.0.0.1", 0), secrets.token_bytes(16)
        self.conns, self.procs, self.group = [], [], None
        self._sent = self._read = 0  # calls sent to the ranks, and answers read
        self._launched: deque[int] = deque()  # the call numbers of the steps in flight
        # one call at a time: with async scheduling a step runs on the core's worker thread
        # while its loop moves a P/D transfer's blocks
        self._lock = threading.RLock()
        with Listener(address, authkey=authkey) as listener:
            try:
                # Plain child processes (an engine core is a daemonic process, which
                # multiprocessing forbids children of its own), or Ray actors.
                for _ in range(1, world if ray else parallel.local_ranks):
                    self.procs.append(_RayRank(listener.address, authkey, timeout) if ray
                                      else _start_rank(listener.address, authkey,
                                                       spin=config.model.omp_spin_count))
                self.conns = _accept(listener, self.procs, world - 1)
                for rank, conn in enumerate(self.conns, 1):
                    conn.send((rank, size, init, config, str(folder)))
                self._sent = 1  # each rank answers once it has loaded
                self.group = TPGroup.join(0, size, init, timeout, stages)
                self.worker = Worker.from_config(config, folder, tp=self.group)
                self._replies(patient=True)  # a load takes what it takes; a crash closes the pipe
            except BaseException:
                self.close()
                raise
        self.info = self.worker.info
        log.info("%d tensor-parallel rank(s) x %d pipeline stage(s) on %d node(s), %d KV "
                 "blocks each", size, stages, parallel.nnodes, self.info.num_blocks)

    def _call(self, method: str, *args):
        """`method(*args)` on every rank's worker; rank 0's result."""
        return self._call_each(method, [args] * (len(self.conns) + 1))[0]

    def _call_each(self, method: str, args: list[tuple], upto: int | None = None) -> list:
        """`method(*args[r])` on each rank r's worker; every rank's result, by rank (the
        others' answers read up to call `upto`, as `_replies`)."""
        with self._lock:
            self._send(method, args[1:])
            failure, result = None, None
            try:
                result = getattr(self.worker, method)(*args[0])
            except Exception as exc:
                failure = f"rank 0: {type(exc).__name__}: {exc}"
            return [result, *self._replies(failure, upto=upto)]

    def _checked(self, method: str, *args) -> None:
        """`method(*args)` on rank 0 first, so what it refuses (an adapter that does not fit
        the model) fails this call alone, as in one process; then on the others."""
        with self._lock:
            getattr(self.worker, method)(*args)
            self._send(method, [args] * len(self.conns))
            self._replies()

    def _send(self, method: str, args: list[tuple]) -> None:
        """The call to ranks 1.., `args[r - 1]` to rank r; each answers it in turn."""
        for rank, conn in enumerate(self.conns, 1):
            try:
                conn.send((method, args[rank - 1]))
            except OSError:  # a rank that died: the group cannot compute any more
                raise RankFailed(f"tensor-parallel rank {rank}: the process is gone") from None
        self._sent += 1

    def _replies(self, failure: str | None = None, patient: bool = False,
                 upto: int | None = None) -> list:
        """Every other rank's answers to the calls sent since the last read, up to call
        number `upto` (None: the last sent), the last one's result of each, waiting at
        most the collectives' timeout and a margin each (`patient`: as long as it takes);
        RankFailed with every failure, `failure` (rank 0's) first."""
        wait = None if patient else self.timeout + 10
        failures, results = [failure] if failure else [], []
        upto = self._sent if upto is None else upto
        calls, self._read = upto - self._read, upto
        for rank, conn in enumerate(self.conns, 1):
            result = None
            for _ in range(calls):
                try:
                    error, result = conn.recv() if conn.poll(wait) else (
                        f"no answer in {wait:g} s", None)
                except (EOFError, OSError):
                    error, result = "the process is gone", None
                if error is not None:
                    failures.append(f"rank {rank}: {error}")
                    break
            results.append(result)
        if failures:
            raise RankFailed("tensor-parallel " + "; ".join(failures))
        return results

    def execute(self, out: SchedulerOutput) -> ModelOutput:
        """Rank 0's output. A step that loads from the tiers below the pool (each rank its
        share of every block) loads whole only what every rank read: inline loads are
        read on every rank first (`prepare`), so that all leave the same requests out."""
        if not out.kv_loads:
            return self._call("execute", out)
        agreed = None  # (counts every rank read, rank 0's seconds)
        if any(x.inline for x in out.kv_loads):
            prepared = self._call_each("prepare", [(out,)] * (len(self.conns) + 1))
            agreed = ({rid: min(counts.get(rid, 0) for counts, _ in prepared)
                       for rid in prepared[0][0]}, prepared[0][1])
        return _all_loaded(self._call_each("execute", [(out, agreed)] * (len(self.conns) + 1)))

    # Several steps in flight (pipeline stages): a step is launched on every rank, and
    # completed, oldest first, after later ones were launched.
    def launch(self, out: SchedulerOutput) -> None:
        self._send("launch", [(out,)] * len(self.conns))
        self._launched.append(self._sent)
        try:
            self.worker.launch(out)
        except Exception as exc:  # the ranks' collectives are out of step: none can go on
            raise RankFailed(f"tensor-parallel rank 0: {type(exc).__name__}: {exc}") from exc

    def complete(self) -> ModelOutput:
        """Rank 0's output of the oldest step in flight. The others' answers are read up
        to their launch of it: a later launch's answer may wait for this completion, and
        their completion's comes with the next (its failure, if any, fails that one)."""
        return _all_loaded(self._call_each("complete", [()] * (len(self.conns) + 1),
                                           upto=self._launched.popleft()))

    def forget(self, rid: str, finished: bool = False) -> None:
        self._call("forget", rid, finished)

    def cut_when(self, check) -> bool:
        return False  # the ranks would have to agree on a layer to stop at

    def compile_constraint(self, params: SamplingParams) -> None:
        # From the compiler thread: rank 0 only (the pipes belong to the step loop); the
        # other ranks compile a constraint when its request first reaches them.
        self.worker.compile_constraint(params)

    def read_blocks(self, block_ids: list[int]) -> tuple[bytes, list[int], str]:
        """The blocks' KV as one process holds it (`KVShards.join`), so an instance of any
        split takes it."""
        parts = self._call_each("read_blocks", [(block_ids,)] * (len(self.conns) + 1))
        return kv_message(self.shards.join([kv_tensor(*part) for part in parts]))

    def write_blocks(self, block_ids: list[int], data: bytes, shape: list[int],
                     dtype: str) -> None:
        """KV as one process holds it (`read_blocks`) into these blocks: each rank its share
        (its stage's layers, its heads)."""
        self.worker.kv.check_fits(shape, dtype, len(block_ids), self.shards.kv_heads,
                                  self.shards.num_layers)
        parts = self.shards.split(kv_tensor(data, shape, dtype))
        self._call_each("write_blocks", [(block_ids, *kv_message(p)) for p in parts])

    def touch_kv_cache(self, block_ids: list[int]) -> None:
        self._call("touch_kv_cache", block_ids)

    def tier_report(self) -> TierReport:
        return self.worker.tier_report()  # rank 0's listing stands for every rank's

    def adapters(self) -> dict[str, str] | None:
        return self.worker.adapters()

    # Each rank holds its share of every adapter (tidal.engine.lora_manager), read from the
    # same path (on its own machine, across nodes).
    def register_adapter(self, name: str, path: str) -> None:
        self._checked("register_adapter", name, path)

    def unregister_adapter(self, name: str) -> None:
        self._checked("unregister_adapter", name)

    def load_adapter(self, name: str) -> None:
        self._checked("load_adapter", name)

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
        if self._store is not None:
            shutil.rmtree(self._store, ignore_errors=True)


def node_key(parallel) -> bytes:
    """The key the ranks of a group spanning machines connect to rank 0 with: from the flags
    every node is started with, so a node started for another group is refused. A check,
    not a secret: the nodes' network must be trusted, as torch.distributed's store is."""
    text = (f"tidal-tp:{parallel.master_addr}:{parallel.master_port}:"
            f"{parallel.tensor_parallel_size}:{parallel.pipeline_parallel_size}:"
            f"{parallel.nnodes}")
    return hashlib.sha256(text.encode()).digest()


class _RayRank:
    """A rank as a Ray actor, behind the part of Popen's interface the executor uses. An
    actor Ray has not started within `timeout` seconds (a cluster without a free CPU for it
    waits forever) fails the group, naming why."""

    def __init__(self, address: tuple[str, int], authkey: bytes, timeout: float) -> None:
        import ray

        self._ray, self._timeout = ray, timeout
        self._actor = ray.remote(num_cpus=1)(_RankActor).remote()
        self._started = self._actor.pid.remote()
        self._deadline = time.monotonic() + timeout
        self._run = self._actor.run.remote(*address, authkey)

    def poll(self) -> int | None:
        done, _ = self._ray.wait([self._run], timeout=0)
        if done:
            return 0
        if self._started is not None:
            if self._ray.wait([self._started], timeout=0)[0]:
                self._started = None
            elif time.monotonic() > self._deadline:
                raise RankFailed(f"Ray started no actor for a tensor-parallel rank within "
                                 f"{self._timeout:.0f} s (--distributed-timeout): each takes "
                                 f"one CPU of the cluster, and `ray status` shows how many "
                                 f"are free")
        return None

    def wait(self, timeout: float | None = None) -> None:
        done, _ = self._ray.wait([self._run], timeout=timeout)
        if not done:
            raise subprocess.TimeoutExpired("tensor-parallel rank actor", timeout)

    def kill(self) -> None:
        self._ray.kill(self._actor, no_restart=True)


class _RankActor:
    """The Ray actor: `run` is a rank's process main; `pid` answers once it started."""

    def pid(self) -> int:
        return os.getpid()

    def run(self, host: str, port: int, authkey: bytes) -> None:
        rank_main(host, port, authkey)


def _ray_node_address() -> str:
    """This node's address in the Ray cluster (RAY_ADDRESS's, or a local one started now)."""
    import ray

    if not ray.is_initialized():
        ray.init(ignore_reinit_error=True, include_dashboard=False, configure_logging=False)
    return ray.util.get_node_ip_address()


# the calls whose every rank's result rank 0 reads (a launch's: the blocks it loaded)
_RESULTS = ("read_blocks", "prepare", "launch")


def _all_loaded(results: list) -> ModelOutput:
    """Rank 0's output of a step, its loads whole only as far as every rank's (the others
    answer its execution, or its launch, with their counts alone)."""
    result = results[0]
    if result.kv_loaded:
        result.kv_loaded = {rid: min([whole, *((other or {}).get(rid, 0)
                                               for other in results[1:])])
                            for rid, whole in result.kv_loaded.items()}
    return result


def _check_own_spin(spin: int | None) -> None:
    """Rank 0 computes in this process, whose OpenMP threads spin as libgomp read the
    environment when torch loaded: `spin` (a GOMP_SPINCOUNT) reaches it only where `LLM`
    or `tidal serve` set it before torch loaded (config.give_omp_spin)."""
    if spin is not None and not {"GOMP_SPINCOUNT", "OMP_WAIT_POLICY"} & set(os.environ):
        log.warning("rank 0 computes in this process, which loaded torch before the engine "
                    "could set its OpenMP spin: its idle threads spin for libgomp's default "
                    "and so hold the cores the other ranks compute on. Start Python with "
                    "GOMP_SPINCOUNT=%d, or create the LLM before importing torch", spin)


def _start_rank(address: tuple[str, int], authkey: bytes, folder: str | None = None,
                patient: bool = False, spin: int | None = None) -> subprocess.Popen:
    """A rank's process, connecting to rank 0 at `address` (`folder`: this machine's copy
    of the model; `patient`: until rank 0 listens; `spin`: its GOMP_SPINCOUNT, unless the
    environment sets one)."""
    argv = [sys.executable, "-m", "tidal.engine.tp_executor", *map(str, address)]
    if folder is not None:
        argv += ["--folder", folder]
    if patient:
        argv.append("--patient")
    env = None if spin is None else {"GOMP_SPINCOUNT": str(spin), **os.environ}
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, env=env)
    proc.stdin.write(authkey)
    proc.stdin.close()
    return proc


def _accept(listener: Listener, procs: list[subprocess.Popen],
            count: int) -> list[Connection]:
    """The other ranks' `count` connections, in the order they came (each is then told its
    rank): as long as their processes start, which may take a while on a busy machine (and
    on other machines, as long as they take to be started); a process of this machine that
    exits first fails the group."""
    conns: list[Connection] = []

    def accept() -> None:
        while len(conns) < count:
            try:
                conns.append(listener.accept())
            except AuthenticationError:  # a node started with other flags
                log.warning("tensor parallel: a rank with other --nnodes, "
                            "--tensor-parallel-size or --master-* flags was refused")
    accepting = threading.Thread(target=accept, daemon=True)
    accepting.start()
    say_at = time.monotonic() + 30
    while accepting.is_alive():
        accepting.join(0.2)
        if any(p.poll() is not None for p in procs):
            raise RankFailed(f"tensor-parallel ranks: {len(conns)} of {count} connected "
                             f"before a rank's process exited")
        if count > len(procs) and time.monotonic() > say_at:  # other machines' ranks
            log.info("tensor parallel: %d of %d ranks connected; waiting for the other "
                     "nodes' (tidal serve --headless)", len(conns), count)
            say_at += 30
    return conns


def rank_main(host: str, port: int, authkey: bytes, folder: str | None = None,
              patient: bool = False) -> None:
    """A rank's process: take its place from rank 0, build its worker, then make each call
    rank 0 sends until told to stop (None) or rank 0 is gone; reply (None, the result), or
    (what went wrong, None). `folder`: this machine's copy of the model (else rank 0's
    path); `patient`: retry until rank 0 listens."""
    while True:
        try:
            conn = Client((host, port), authkey=authkey)
            break
        except AuthenticationError:
            raise SystemExit(f"tensor-parallel rank: rank 0 at {host}:{port} refused this "
                             f"node: start every node with the same --tensor-parallel-size, "
                             f"--nnodes and --master-* flags") from None
        except OSError:  # nobody listens yet (rank 0's machine is still starting)
            if not patient:
                raise
            time.sleep(0.5)
    try:
        rank, size, init, config, rank0_folder = conn.recv()
        logging.basicConfig(level=max(logging.WARNING,  # the ranks' lines repeat rank 0's
                                      logging.getLevelName(config.model.log_level.upper())),
                            format=f"%(asctime)s tp-rank-{rank} %(name)s: %(message)s")
        group = TPGroup.join(rank, size, init, config.parallel.distributed_timeout,
                             config.parallel.pipeline_parallel_size)
        worker = Worker.from_config(config, folder or rank0_folder, tp=group)
        conn.send((None, None))
    except Exception as exc:
        conn.send((f"{type(exc).__name__}: {exc}", None))
        return
    try:
        while True:
            try:
                call = conn.recv()
            except (EOFError, OSError):
                return  # rank 0's process is gone
            if call is None:
                return
            method, args = call
            try:
                result = getattr(worker, method)(*args)
            except Exception as exc:
                conn.send((f"{type(exc).__name__}: {exc}", None))
            else:  # a step's output is rank 0's: the others' would only cost pickling,
                # but for the blocks each loaded (a load is whole only where all read it)
                conn.send((None, result if method in _RESULTS else
                           result.kv_loaded or None if isinstance(result, ModelOutput)
                           else None))
    finally:  # a later stage's first rank made its stage's shared segment: it removes it
        worker.close()  # its disk tier's pending blocks written
        group.close()


def serve_node(parallel, folder: str | Path) -> None:
    """`tidal serve --headless`: this machine's ranks of node 0's group, started again each
    time they exit (node 0's engine core stopped or restarted: it forms a new group), until
    this process is stopped."""
    address = (parallel.master_addr, parallel.master_port)
    log.info("node %d of %d: %d tensor-parallel ranks for %s:%d", parallel.node_rank,
             parallel.nnodes, parallel.local_ranks, *address)
    # stopped (SIGTERM, as a service manager stops it): its ranks go with it, not on
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    procs: list[subprocess.Popen] = []
    try:
        while True:
            procs = [_start_rank(address, node_key(parallel), str(folder), patient=True)
                     for _ in range(parallel.local_ranks)]
            for proc in procs:
                proc.wait()
            log.info("node %d: the group ended (rank exit codes %s); its ranks start again",
                     parallel.node_rank, [p.returncode for p in procs])
            time.sleep(1)  # a group that ends at once is not restarted in a tight loop
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


if __name__ == "__main__":  # a rank: `python -m tidal.engine.tp_executor HOST PORT
    # [--folder F] [--patient]`, the key on stdin
    rank_main(sys.argv[1], int(sys.argv[2]), sys.stdin.buffer.read(),
              sys.argv[sys.argv.index("--folder") + 1] if "--folder" in sys.argv else None,
              "--patient" in sys.argv)
