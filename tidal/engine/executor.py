"""Between the engine core and the model: an executor hands each step's plan to the model's
workers and returns what they sampled. The engine core, the step-time profile and the KV
transfers talk to an executor only, so workers on other processes or ranks (tensor or
pipeline parallelism: each holds its shard of the model and of every KV block, under the
same block tables) need no change above it.

`LocalExecutor`: one worker, in this process; `TensorParallelExecutor` (tp_executor.py):
one per rank of a tensor-parallel group.
"""

from __future__ import annotations

from typing import Callable, Protocol

from tidal.core import ModelOutput, SamplingParams, SchedulerOutput
from tidal.core.kv_tiers import TierReport
from tidal.engine.worker import Worker, WorkerInfo


class ExecutorDead(RuntimeError):
    """The executor's workers can no longer run steps (a tensor-parallel rank died, hung or
    failed mid-step): the engine core stops, and a server restarts it."""


class Executor(Protocol):
    """Runs steps on the model's workers."""

    info: WorkerInfo

    def execute(self, out: SchedulerOutput) -> ModelOutput:
        """Run one step on every worker; what the step sampled."""
        ...

    def forget(self, rid: str, finished: bool = False) -> None:
        """Drop a request the engine ran outside its plans (the step-time profile's)."""
        ...

    def cut_when(self, check: Callable[[], bool]) -> bool:
        """Let the workers stop a `cuttable` step between layers once `check()` (asked
        before each layer); whether they can (ranks in other processes could not stop at
        the same layer)."""
        ...

    def compile_constraint(self, params: SamplingParams) -> None:
        """Compile a request's output constraint (ValueError if it cannot be), from any
        thread."""
        ...

    def read_blocks(self, block_ids: list[int]) -> tuple[bytes, list[int], str]: ...

    def write_blocks(self, block_ids: list[int], data: bytes, shape: list[int],
                     dtype: str) -> None: ...

    def touch_kv_cache(self, block_ids: list[int]) -> None:
        """Write the pages of the workers' KV blocks `block_ids` (the step-time profile times
        steps over contexts nobody wrote: `KVCache.touch`)."""
        ...

    def tier_report(self) -> TierReport:
        """Blocks other engine cores wrote to the disk tier or deleted since the last call;
        host memory's figures (`KVTiers.learn`)."""
        ...

    def adapters(self) -> dict[str, str] | None: ...

    def register_adapter(self, name: str, path: str) -> None: ...

    def unregister_adapter(self, name: str) -> None: ...

    def load_adapter(self, name: str) -> None: ...

    def close(self) -> None:
        """Stop the workers that are not in this process."""
        ...


class LocalExecutor:
    """One worker in this process: each call is the worker's own (no copy, no IPC)."""

    def __init__(self, worker: Worker) -> None:
        self.worker, self.info = worker, worker.info

    def execute(self, out: SchedulerOutput) -> ModelOutput:
        return self.worker.execute(out)

    def forget(self, rid: str, finished: bool = False) -> None:
        self.worker.forget(rid, finished)

    def cut_when(self, check: Callable[[], bool]) -> bool:
        self.worker.runner.cut_check = check
        return True

    def compile_constraint(self, params: SamplingParams) -> None:
        self.worker.compile_constraint(params)

    def read_blocks(self, block_ids: list[int]) -> tuple[bytes, list[int], str]:
        return self.worker.read_blocks(block_ids)

    def write_blocks(self, block_ids: list[int], data: bytes, shape: list[int],
                     dtype: str) -> None:
        self.worker.write_blocks(block_ids, data, shape, dtype)

    def touch_kv_cache(self, block_ids: list[int]) -> None:
        self.worker.touch_kv_cache(block_ids)

    def tier_report(self) -> TierReport:
        return self.worker.tier_report()

    def adapters(self) -> dict[str, str] | None:
        return self.worker.adapters()

    def register_adapter(self, name: str, path: str) -> None:
        self.worker.register_adapter(name, path)

    def unregister_adapter(self, name: str) -> None:
        self.worker.unregister_adapter(name)

    def load_adapter(self, name: str) -> None:
        self.worker.load_adapter(name)

    def close(self) -> None:
        self.worker.close()  # this process's: its disk tier's writes finish
