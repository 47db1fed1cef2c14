"""The order in which waiting requests are offered admission."""

from __future__ import annotations

from typing import Callable, Sequence

from tidal.core.config import SchedulerConfig
from tidal.core.request import Request


class Policy:
    """First come, first served: the queue's own order (retracted requests rejoin its tail)."""

    decode_while_prefilling = True  # may decodes share a step with a chunked prefill?

    def order(self, waiting: Sequence[Request], step: int,
              prefix_tokens: Callable[[Request], int]) -> Sequence[Request]:
        return waiting


class PrefillFirst(Policy):
    """FCFS, and no decode step while a chunked prefill is unfinished."""

    decode_while_prefilling = False


class PriorityPolicy(Policy):
    """Lowest `priority` value first, then arrival."""

    def order(self, waiting, step, prefix_tokens):
        return sorted(waiting, key=lambda r: (r.sampling_params.priority, r.arrival_time))


class LongestPrefixMatch(Policy):
    """Most cached prefix tokens first. A request that has waited `aging_steps` steps goes
    ahead of every younger one, so cache-cold requests cannot starve."""

    def __init__(self, aging_steps: int, max_queue: int) -> None:
        self.aging_steps = aging_steps
        self.max_queue = max_queue

    def order(self, waiting, step, prefix_tokens):
        if len(waiting) > self.max_queue:
            return waiting

        def key(r: Request) -> tuple:
            if step - r.enqueue_step >= self.aging_steps:
                return (0, 0, r.arrival_time)
            return (1, -prefix_tokens(r), r.arrival_time)

        return sorted(waiting, key=key)


def make_policy(config: SchedulerConfig) -> Policy:
    if config.policy == "prefill_first":
        return PrefillFirst()
    if config.policy == "priority":
        return PriorityPolicy()
    if config.policy == "longest_prefix_match":
        return LongestPrefixMatch(config.lpm_aging_steps, config.lpm_max_queue)
    return Policy()
