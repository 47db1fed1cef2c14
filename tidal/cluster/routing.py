"""Which engine core gets a request: the data-parallel routing policies. Pure Python, so the
real dispatcher and the simulator pick cores with the same code."""

from __future__ import annotations

from dataclasses import dataclass

# the names are configuration (dp_routing)
from tidal.engine.parallel_config import ROUTING_POLICIES


@dataclass
class CoreLoad:
    """What a core reports (or the simulator reads) when a request is routed."""

    outstanding_tokens: int = 0  # prompt tokens still to compute + output tokens still to make
    free_blocks: int = 0
    prefix_hit_tokens: int = 0  # tokens of this request's prompt already cached there
    prefill_tokens: int = 0  # prompt tokens queued there: what a new request's TTFT waits on
    available: bool = True  # False: the core is gone; never chosen


class Router:
    """`round_robin` cycles; `least_tokens` picks the core with the fewest outstanding
    tokens; `prefix_aware` picks the core caching the longest prefix of the prompt, and the
    least loaded one when no core caches any of it; `slack` picks the core where the request
    would have the most slack to its TTFT deadline: the fewest prompt tokens queued ahead of
    it (cores alike), then the fewest outstanding tokens."""

    def __init__(self, policy: str, num_cores: int) -> None:
        if policy not in ROUTING_POLICIES:
            raise ValueError(f"routing policy must be one of {', '.join(ROUTING_POLICIES)}; "
                             f"got {policy!r}")
        if num_cores < 1:
            raise ValueError("a router needs at least one core")
        self.policy, self.num_cores = policy, num_cores
        self._next = 0

    @property
    def needs_prefix(self) -> bool:
        """Whether `choose` reads prefix_hit_tokens (worth computing only then)."""
        return self.policy == "prefix_aware"

    @property
    def needs_backlog(self) -> bool:
        """Whether `choose` reads prefill_tokens."""
        return self.policy == "slack"

    def choose(self, loads: list[CoreLoad]) -> int:
        """The chosen core's index; at least one load must be available (round robin may
        get no loads at all: every core is then available)."""
        live = [i for i, load in enumerate(loads) if load.available]
        if self.policy == "round_robin":
            while loads and not loads[self._next].available:
                self._next = (self._next + 1) % self.num_cores
            core, self._next = self._next, (self._next + 1) % self.num_cores
            return core
        if self.policy == "slack":
            return min(live, key=lambda i: (loads[i].prefill_tokens,
                                            loads[i].outstanding_tokens, i))
        least = min(live, key=lambda i: (loads[i].outstanding_tokens, i))
        if self.policy == "least_tokens":
            return least
        best = max(live, key=lambda i: (loads[i].prefix_hit_tokens,
                                        -loads[i].outstanding_tokens))
        return best if loads[best].prefix_hit_tokens > 0 else least
