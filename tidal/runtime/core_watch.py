"""Engine-core death and restarts, as the frontend sees them.

A core that dies has its in-flight requests failed and is started again with the same config
on the same sockets, under a `RestartPolicy`: up to `max_restarts` tries in a row, the first
after `backoff` seconds and each next one after twice as long; a core that served for
`stable_after` seconds before it died gets its tries back. Every start of a core is a new
incarnation, named in its messages, so that late messages of a dead one are dropped."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable

log = logging.getLogger("tidal.server")
POLL_SECONDS = 0.2  # the watchdog's period
STALL_SECONDS = 1.0  # a period this late means the frontend's own event loop was blocked


@dataclass(frozen=True)
class RestartPolicy:
    """How a dead engine core is started again (`tidal serve --restart-core/--restart-backoff`)."""

    max_restarts: int = 3  # tries in a row; 0: a dead core stays dead
    backoff: float = 1.0  # seconds before the first try, doubled for each next one
    stable_after: float = 600.0  # a core up this long when it dies gets its tries back
    hang_timeout: float = 0.0  # seconds without a message that make a live core hung (0: off)

    def __post_init__(self) -> None:
        if self.max_restarts < 0 or self.backoff < 0 or self.hang_timeout < 0:
            raise ValueError("--restart-core, --restart-backoff and --core-hang-timeout "
                             "must be >= 0")

    def delay(self, attempt: int) -> float:
        """Seconds before try `attempt` (0-based) of a run of restarts."""
        return self.backoff * 2 ** attempt


@dataclass
class CoreState:
    """One engine core: its current process (handle), and how it has fared."""

    index: int
    handle: Any = None
    incarnation: int = 0
    up: bool = False  # Ready, serving
    starting: bool = False  # launched, not Ready yet
    restarting: bool = False  # dead, another try to come
    gone: bool = False  # dead for good: restarts off or spent
    reason: str | None = None  # why it last went down (or failed to start)
    restarts: int = 0  # processes started after the first
    attempts: int = 0  # tries in the current run of restarts
    up_since: float = 0.0
    next_try: float = 0.0  # monotonic time of the next start while restarting
    ready: Any = None  # its latest Ready message
    failure: str | None = None  # a Failed message's text while starting
    last_heard: float = 0.0  # monotonic time of its latest message (the watchdog's clock)
    hung: str | None = None  # why the watchdog killed it
    event: asyncio.Event = field(default_factory=asyncio.Event)

    def status(self) -> dict:
        """For /health: this core's pid, state and restarts."""
        out = {"core": self.index, "pid": self.handle.pid if self.handle else None,
               "up": self.up, "restarting": self.restarting, "restarts": self.restarts}
        if not self.up and self.reason:
            out["reason"] = self.reason
        return out


class CoreWatch:
    """Watches the cores of one frontend: notices a death, tells the frontend which core went
    down (`on_down`) and came back (`on_up`), restarts under the policy, and once every core
    is gone for good says why (`on_gone`). `launch(index, incarnation, old_handle)` starts
    a process and returns its handle."""

    def __init__(self, num_cores: int, policy: RestartPolicy,
                 launch: Callable[[int, int, Any], Any], on_down: Callable[[int, str], None],
                 on_up: Callable[[int, Any], None], on_gone: Callable[[str], None],
                 handles: list[Any] | None = None) -> None:
        self.policy = policy
        self.cores = [CoreState(i, handle=h) for i, h in
                      enumerate(handles if handles is not None else [None] * num_cores)]
        self._launch, self._on_down, self._on_up, self._on_gone = launch, on_down, on_up, on_gone
        self.startup_seconds = 10.0  # how long a start took, for Retry-After
        self.start_timeout = 600.0
        self.closing = False
        self._tasks: set[asyncio.Task] = set()

    # ------------------------------------------------------------------ starting
    def launch(self, state: CoreState) -> None:
        """Start the first incarnation of the core."""
        self._next_incarnation(state)
        state.handle = self._launch(state.index, state.incarnation, state.handle)

    def _next_incarnation(self, state: CoreState) -> None:
        state.incarnation += 1
        state.event.clear()
        state.failure, state.ready, state.starting = None, None, True

    async def wait_ready(self, state: CoreState, timeout: float) -> bool:
        """Until the launched core says Ready (True) or fails to start (False, with why)."""
        deadline = time.monotonic() + timeout
        while not state.event.is_set():
            if not state.handle.alive():
                await asyncio.sleep(0.05)  # a Failed sent just before exiting may be in flight
                if not state.event.is_set():
                    state.reason = state.failure or state.handle.exit_reason()
                    state.starting = False
                    return False
            if time.monotonic() > deadline:
                state.reason, state.starting = "it did not start in time", False
                return False
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(state.event.wait(), 0.2)
        state.starting = False
        if state.failure is not None:
            state.reason = state.failure
            return False
        state.up, state.up_since = True, time.monotonic()
        state.last_heard, state.hung = state.up_since, None
        return True

    # ------------------------------------------------------------------ messages
    def current(self, core: int, incarnation: int) -> bool:
        """Whether a message comes from the live (or starting) incarnation of `core`."""
        state = self.cores[core] if 0 <= core < len(self.cores) else None
        return (state is not None and state.incarnation == incarnation
                and (state.up or state.starting))

    def heard(self, core: int) -> None:
        """A message from the live incarnation of `core`: it is not hung."""
        self.cores[core].last_heard = time.monotonic()

    def on_ready(self, msg) -> None:
        if self.current(msg.core, msg.incarnation) and self.cores[msg.core].starting:
            self.cores[msg.core].ready = msg
            self.cores[msg.core].event.set()

    def on_failed(self, msg) -> None:
        if self.current(msg.core, msg.incarnation):
            self.cores[msg.core].failure = f"it failed to start: {msg.message}"
            self.cores[msg.core].event.set()

    # ------------------------------------------------------------------ the watch
    @property
    def alive(self) -> bool:
        return any(s.up for s in self.cores)

    @property
    def restarting(self) -> bool:
        return any(s.restarting for s in self.cores)

    def retry_after(self) -> int:
        """Seconds until a restarting core should serve again (at least 1)."""
        now = time.monotonic()
        waits = [max(0.0, s.next_try - now) + self.startup_seconds
                 - max(0.0, now - s.next_try) for s in self.cores if s.restarting]
        return max(1, math.ceil(min(waits, default=1.0)))

    async def run(self) -> None:
        """Poll the cores' processes until every core is gone for good (or closing)."""
        hang, tick = self.policy.hang_timeout, time.monotonic()
        while not self.closing and not all(s.gone for s in self.cores):
            await asyncio.sleep(POLL_SECONDS)
            now, last = time.monotonic(), tick
            tick = now
            if now - last > STALL_SECONDS:
                # this process's own loop stalled: the cores' heartbeats may wait unread
                # behind this tick, so the stall is no silence of theirs
                for state in self.cores:
                    state.last_heard += now - last - POLL_SECONDS
            for state in self.cores:
                if not state.up or self.closing:
                    continue
                if not state.handle.alive():
                    self.died(state)
                elif hang and time.monotonic() - state.last_heard > hang and not state.hung:
                    # stopped or stuck in a step: a process that answers nothing is killed,
                    # and the next poll finds it dead
                    state.hung = (f"it sent nothing for {hang:g} s (--core-hang-timeout) and "
                                  f"was killed")
                    log.error("engine core %d: %s", state.index, state.hung)
                    state.handle.kill()

    def stop(self, state: CoreState) -> None:
        """Stop a serving core on purpose (sleep, a weight update): not a death, so it is
        not restarted; its memory returns to the machine."""
        state.up = False  # the watch leaves it alone; its late messages are stale
        state.handle.kill()

    async def start(self, state: CoreState) -> bool:
        """Start a core `stop` stopped (the launch reads the frontend's folder now): whether
        it serves. One that does not is left down for the caller."""
        if not await self._relaunch(state):
            state.handle.kill()
            return False
        self._on_up(state.index, state.ready)
        return True

    async def _relaunch(self, state: CoreState) -> bool:
        """Launch a new incarnation of the core and wait for it: whether it serves."""
        self._next_incarnation(state)
        try:  # on a thread: placing a Ray actor blocks until it runs
            state.handle = await asyncio.to_thread(self._launch, state.index,
                                                   state.incarnation, state.handle)
        except Exception as exc:  # e.g. Ray could not place the actor
            state.reason, state.starting = f"{type(exc).__name__}: {exc}", False
            return False
        return await self.wait_ready(state, self.start_timeout)

    def close(self) -> None:
        """Start nothing more; stop restarts under way."""
        self.closing = True
        for task in list(self._tasks):
            task.cancel()

    def died(self, state: CoreState) -> None:
        """The core is down: restart it under the policy, or give it up."""
        state.up, state.reason = False, state.hung or state.handle.exit_reason()
        if time.monotonic() - state.up_since >= self.policy.stable_after:
            state.attempts = 0
        more = state.attempts < self.policy.max_restarts
        state.restarting = more
        log.error("engine core %d: %s%s", state.index, state.reason,
                  "; restarting it" if more else "")
        self._on_down(state.index, f"engine core {state.index}: {state.reason}")
        if more:
            task = asyncio.create_task(self._restart(state))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        else:
            self._give_up(state)

    async def _restart(self, state: CoreState) -> None:
        while state.attempts < self.policy.max_restarts:
            delay = self.policy.delay(state.attempts)
            state.attempts += 1
            state.next_try = time.monotonic() + delay
            await asyncio.sleep(delay)
            if self.closing:
                return
            state.restarts += 1
            log.warning("engine core %d: restart %d of %d", state.index, state.attempts,
                        self.policy.max_restarts)
            if await self._relaunch(state):  # a launch that raised counts as a try
                state.restarting = False
                log.warning("engine core %d is back (pid %s)", state.index, state.handle.pid)
                self._on_up(state.index, state.ready)
                return
            log.error("engine core %d: restart failed: %s", state.index, state.reason)
            state.handle.kill()
        self._give_up(state)

    def _give_up(self, state: CoreState) -> None:
        state.restarting, state.gone = False, True
        if self.policy.max_restarts:
            state.reason = (f"{state.reason}; not restarted again after {state.attempts} "
                            f"restart(s) (--restart-core {self.policy.max_restarts})")
        else:  # say it: a client reading /health should not wait for it
            state.reason = f"{state.reason}; it will not be restarted (--restart-core 0)"
        if all(s.gone for s in self.cores):
            self._on_gone(f"engine core {state.index}: {state.reason}")
