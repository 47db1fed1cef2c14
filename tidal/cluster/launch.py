"""Where engine cores run: a spawned local process, or a Ray actor (`--dp-backend ray`). Both
run the main the caller hands to `start` (the runtime's `run_core`) and talk ZMQ to the
frontend, so the dispatcher and the client are one code for either backend; a handle only
starts, watches and stops its core."""

from __future__ import annotations

import multiprocessing
import os
import re
from typing import Any, Callable

from tidal.engine.config import give_omp_spin

# The core's main, e.g. tidal.runtime.core_process.run_core: passed in, so that this layer
# imports nothing from the runtime above it. Module-level, so spawn and Ray can pickle it.
CoreMain = Callable[..., None]


class LocalCore:
    """An engine core in a child process (spawned: no forked torch or asyncio state)."""

    def __init__(self, index: int, gpu: bool) -> None:
        self.index = index
        self._proc: multiprocessing.process.BaseProcess | None = None

    def start(self, main: CoreMain, args: tuple) -> None:
        """Run `main(*args)` in a spawned child; args[0] is the core's EngineConfig."""
        give_omp_spin(args[0].model)  # the child inherits it, before it loads torch
        spawn = multiprocessing.get_context("spawn")
        self._proc = spawn.Process(target=main, args=args, daemon=True,
                                   name=f"tidal-engine-core-{self.index}")
        self._proc.start()

    def alive(self) -> bool:
        return self._proc is not None and self._proc.is_alive()

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def exit_reason(self) -> str:
        return f"the engine core process exited (code {self._proc.exitcode})"

    def wait(self, timeout: float) -> None:
        self._proc.join(timeout)

    def kill(self) -> None:
        if self._proc is not None and self._proc.is_alive():
            self._proc.kill()
            self._proc.join(timeout=5)


class RayCore:
    """An engine core placed as a Ray actor (one CPU, or one GPU on a GPU node). Joins the
    Ray cluster named by RAY_ADDRESS, or starts a local one."""

    def __init__(self, index: int, gpu: bool) -> None:
        import ray

        if not ray.is_initialized():
            ray.init(ignore_reinit_error=True, include_dashboard=False,
                     configure_logging=False)
        actor_cls = ray.remote(num_cpus=0 if gpu else 1, num_gpus=1 if gpu else 0,
                               max_concurrency=2)(_CoreActor)
        self.index, self._ray = index, ray
        self._actor = actor_cls.remote()
        self._run = None
        self._pid: int | None = None

    def start(self, main: CoreMain, args: tuple) -> None:
        """Run `main(*args)` in the actor."""
        self._pid = self._ray.get(self._actor.pid.remote())
        self._run = self._actor.run.remote(main, *args)

    def alive(self) -> bool:
        if self._run is None:
            return False
        done, _ = self._ray.wait([self._run], timeout=0)
        return not done

    @property
    def pid(self) -> int | None:
        return self._pid

    def exit_reason(self) -> str:
        try:
            self._ray.get(self._run, timeout=0)
            return "the engine core actor returned"
        except Exception as exc:  # the actor died or raised
            return f"the engine core actor died: {type(exc).__name__}: {str(exc)[:200]}"

    def wait(self, timeout: float) -> None:
        if self._run is not None:
            self._ray.wait([self._run], timeout=timeout)

    def kill(self) -> None:
        self._ray.kill(self._actor, no_restart=True)


class _CoreActor:
    """The Ray actor: `run` blocks in the core's loop; `pid` answers beside it."""

    def pid(self) -> int:
        return os.getpid()

    def run(self, main: CoreMain, *args: Any) -> None:
        main(*args)


def core_handle(backend: str, index: int, gpu: bool) -> LocalCore | RayCore:
    """A handle for core `index` (starts a local Ray cluster on the first Ray core); the
    backend name was checked by ParallelConfig."""
    return (RayCore if backend == "ray" else LocalCore)(index, gpu)


def frontend_host(backend: str) -> str | None:
    """Where cores reach the frontend: None (ipc sockets) for local processes, this node's
    IP for Ray actors, which may run on other nodes."""
    if backend == "local":
        return None
    import ray

    return ray.util.get_node_ip_address()


def parse_pd(text: str) -> tuple[int, int]:
    """A P/D topology, "xPyD" (x prefill and y decode instances, each at least 1), as (x, y);
    ValueError otherwise."""
    match = re.fullmatch(r"(\d+)P(\d+)D", text.upper())
    if not match or min(int(match[1]), int(match[2])) < 1:
        raise ValueError(f"pd expects xPyD with x, y >= 1 (e.g. 1P3D); got {text!r}")
    return int(match[1]), int(match[2])
