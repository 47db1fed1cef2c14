"""When each request of a benchmark is sent: a gamma process (Poisson at burstiness 1), all at
once, or the trace's own timestamps."""

from __future__ import annotations

import math

import numpy as np

from tidal.bench.dataset import BenchRequest


def arrival_times(requests: list[BenchRequest], request_rate: float | None,
                  burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Send times in seconds from the start. `request_rate` None replays the trace's
    timestamps where the dataset has them (else sends everything at once); inf sends
    everything at once; a finite rate draws gamma intervals of mean 1/rate whose shape is
    `burstiness` (below 1 burstier than Poisson, above 1 more regular)."""
    if burstiness <= 0:
        raise ValueError("burstiness must be positive")
    if request_rate is not None and request_rate <= 0:
        raise ValueError("request_rate must be positive (inf: all at once)")
    n = len(requests)
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
