"""`longest_prefix_match`: requests with the most cached prefix go first, with aging."""

from __future__ import annotations

from dataclasses import dataclass

from tidal.core.knobs import check_at_least_one, knob
from tidal.core.policies.base import Policy
from tidal.core.request import Request


class LongestPrefixMatch(Policy):
    """Most cached prefix tokens first. A request that has waited `lpm_aging_steps` steps
    goes ahead of every younger one, so cache-cold requests cannot starve; past
    `lpm_max_queue` waiting requests the queue keeps its own order (matching every prefix
    each step would cost more than it saves)."""

    @dataclass(frozen=True)
    class Options(Policy.Options):
        """How long a cache-cold request may wait, and the queue length the policy sorts."""

        lpm_aging_steps: int = knob(
            64, "A request waiting this many steps goes first regardless of its cache hit, "
            "so cold requests cannot starve.")
        lpm_max_queue: int = knob(
            128, "With more waiting requests than this, fall back to fcfs (matching every "
            "prefix each step would cost more than it saves).")

        def __post_init__(self) -> None:
            check_at_least_one(self, "lpm_aging_steps")

    name = "longest_prefix_match"

    def __init__(self, config) -> None:
        super().__init__(config)
        self.aging_steps = self.options.lpm_aging_steps
        self.max_queue = self.options.lpm_max_queue

    def order(self, waiting, step, prefix_tokens):
        if len(waiting) > self.max_queue:
            return waiting

        def key(r: Request) -> tuple:
            if step - r.enqueue_step >= self.aging_steps:
                return (0, 0, r.arrival_time)
            return (1, -prefix_tokens(r), r.arrival_time)

        return sorted(waiting, key=key)
