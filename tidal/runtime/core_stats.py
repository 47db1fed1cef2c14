"""The cores' latest Stats, one slot per core, and their sum as one engine's."""

from __future__ import annotations

import time
from dataclasses import fields

from tidal.core.invariants import SchedulerStats
from tidal.core.step_time import ERROR_QUANTILES
from tidal.engine import messages as m


class CoreStatsBoard:
    """Each core's latest report; a dead core's slot is emptied until it reports again."""

    def __init__(self, num_cores: int) -> None:
        self.latest: list[m.Stats | None] = [None] * num_cores
        self.arrived = [0.0] * num_cores  # when (time.time) each latest report came
        # tokens sampled per second over the last second or more of each core's reports,
        # from the anchor (time, tokens, incarnation) the interval starts at
        self.gen_rate = [0.0] * num_cores
        self._anchor: list[tuple[float, int, int] | None] = [None] * num_cores

    def record(self, stats: m.Stats) -> None:
        core, now = stats.core, time.time()
        self.latest[core], self.arrived[core] = stats, now
        anchor = self._anchor[core]
        if anchor is None or anchor[2] != stats.incarnation:  # a (re)started core
            self.gen_rate[core], self._anchor[core] = 0.0, (now, stats.generation_tokens,
                                                            stats.incarnation)
        elif now - anchor[0] >= 1.0:
            self.gen_rate[core] = (stats.generation_tokens - anchor[1]) / (now - anchor[0])
            self._anchor[core] = (now, stats.generation_tokens, stats.incarnation)

    def clear(self, core: int) -> None:
        self.latest[core] = None

    def merged(self, cores: list[int]) -> m.Stats | None:
        """The stats of `cores` (the serving ones), summed; None until every one reported."""
        got = [self.latest[i] for i in cores]
        if not got or any(s is None for s in got):
            return None
        return got[0] if len(got) == 1 else merge_stats(got)  # type: ignore[arg-type]


def merge_stats(stats: list[m.Stats]) -> m.Stats:
    """Data-parallel cores' stats as one engine's: counts summed, shares recomputed."""
    lists = ("running_loras", "waiting_loras")  # adapter names: their union
    total = {f.name: sum(getattr(s.scheduler, f.name) for s in stats)
             for f in fields(SchedulerStats) if f.name not in lists}
    for name in lists:
        total[name] = sorted({a for s in stats for a in getattr(s.scheduler, name)})
    total["kv_usage"] = total["used_blocks"] / max(1, total["num_blocks"])
    total["prefix_hit_rate"] = total["prefix_hit_tokens"] / max(1, total["prefix_query_tokens"])
    total["new_token_ratio"] /= len(stats)
    total["tier_load_ms"] /= len(stats)
    total["num_steps"] = max(s.scheduler.num_steps for s in stats)
    errors = [s.step_time_error for s in stats if s.step_time_error]
    # the widest spread of the cores' errors: the lowest low quantiles, the highest high ones
    worst = [(min if q < 0.5 else max)(e[i] for e in errors)
             for i, q in enumerate(ERROR_QUANTILES)] if errors else []
    coefs = [s.step_time_coef for s in stats if s.step_time_coef]
    mean = [sum(c) / len(coefs) for c in zip(*coefs)]  # the cores' models, term by term
    return m.Stats(-1, sum(s.adds_seen for s in stats), SchedulerStats(**total),
                   sum(s.prompt_tokens for s in stats), sum(s.generation_tokens for s in stats),
                   sum(s.execute_seconds for s in stats), sum(s.step_seconds for s in stats),
                   step_time_error=worst, step_time_coef=mean,
                   max_step_ms=max(s.max_step_ms for s in stats))
