"""When each request of a benchmark is sent: a gamma process (Poisson at burstiness 1), all at
once, the trace's own timestamps, or a gamma process whose rate ramps from one value to
another over the run (vLLM's --ramp-up-strategy)."""

from __future__ import annotations

import math
from datetime import datetime

import numpy as np

from tidal.bench.dataset import BenchRequest


RAMPS = ("linear", "exponential")


def ramp_rates(strategy: str, start: float, end: float, n: int) -> np.ndarray:
    """The rate (requests/s) at which each of `n` requests arrives: from `start` at the
    first to `end` at the last, in even steps (linear) or even ratios (exponential)."""
    if strategy not in RAMPS:
        raise ValueError(f"the ramp-up strategy is one of {', '.join(RAMPS)}, not "
                         f"{strategy!r}")
    if end <= 0 or start < 0 or (strategy == "exponential" and start == 0):
        raise ValueError(f"a ramp-up's rates must be above 0 (a linear one may start at 0); "
                         f"got {start:g} to {end:g}")
    progress = np.arange(n) / max(n - 1, 1)
    if strategy == "linear":
        return start + (end - start) * progress
    return start * (end / start) ** progress


def arrival_times(requests: list[BenchRequest], request_rate: float | None,
                  burstiness: float = 1.0, seed: int = 0,
                  ramp: tuple[str, float, float] | None = None) -> list[float]:
    """Send times in seconds from the start. `request_rate` None replays the trace's
    timestamps where the dataset has them (else sends everything at once); inf sends
    everything at once; a finite rate draws gamma intervals of mean 1/rate whose shape is
    `burstiness` (below 1 burstier than Poisson, above 1 more regular). `ramp` (strategy,
    start, end) draws each interval at the rate `ramp_rates` gives its request instead."""
    if burstiness <= 0:
        raise ValueError("burstiness must be positive")
    n = len(requests)
    if ramp is not None:
        rates = ramp_rates(*ramp, n)
        unit = np.random.default_rng(seed).gamma(burstiness, 1 / burstiness, n)
        gaps = np.divide(unit, rates, out=np.zeros(n), where=rates > 0)
        gaps[0] = 0.0  # the first request goes at once
        return np.cumsum(gaps).tolist()
    if request_rate is not None and request_rate <= 0:
        raise ValueError("request_rate must be positive (inf: all at once)")
    if request_rate is None:
        if requests and requests[0].arrival is not None:
            t0 = requests[0].arrival
            return [max(0.0, r.arrival - t0) for r in requests]
        request_rate = math.inf
    if math.isinf(request_rate):
        return [0.0] * n
    gaps = np.random.default_rng(seed).gamma(burstiness, 1 / (request_rate * burstiness), n)
    gaps[0] = 0.0  # the first request goes at once
    return np.cumsum(gaps).tolist()


def rps_change_events(rates, sent: list[float], wall_start: float) -> list[dict]:
    """vLLM's rps_change_events of a ramped run: the starting rate at the run's start, then
    each whole rate the ramp reaches, stamped (ISO time) with the send of its first
    request; `sent`: each request's send in seconds from `wall_start` (a time.time())."""
    stamp = lambda t: datetime.fromtimestamp(wall_start + t).isoformat()  # noqa: E731
    last = int(rates[0]) if len(rates) else 0
    events = [{"rps": last, "timestamp": stamp(0.0)}]
    for rate, t in zip(rates, sent):
        events += [{"rps": rps, "timestamp": stamp(t)} for rps in range(last + 1, int(rate) + 1)]
        last = max(last, int(rate))
    return events
