"""`priority`: the request's own priority decides the queue order."""

from __future__ import annotations

from tidal.core.policies.base import Policy


class PriorityPolicy(Policy):
    """Lowest `priority` value first, then arrival."""

    name = "priority"

    def order(self, waiting, step, prefix_tokens):
        return sorted(waiting, key=lambda r: (r.sampling_params.priority, r.arrival_time))
