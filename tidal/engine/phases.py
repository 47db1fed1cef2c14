"""Where a start's seconds go: each phase's wall time, logged in one line."""

from __future__ import annotations

import time


class Phases:
    """Wall time of a start's named phases, each from the end of the one before."""

    def __init__(self) -> None:
        self.start = self._last = time.perf_counter()
        self.times: list[tuple[str, float]] = []

    def done(self, name: str) -> None:
        """The phase `name` ends now."""
        now = time.perf_counter()
        self.times.append((name, now - self._last))
        self._last = now

    @property
    def total(self) -> float:
        return self._last - self.start

    def __str__(self) -> str:
        return ", ".join(f"{name} {seconds:.2f}s" for name, seconds in self.times)
