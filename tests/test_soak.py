"""The CI version of `benchmarks/soak.py`: 300 requests of the soak's mix (chat and
completions, n up to 4, logprobs, stop strings, penalties; 20% of clients leave mid-stream,
10% give up on a non-streaming answer) against a real server. Every request that ran to its
end is well formed, the server holds nothing afterwards, and neither process grows.

The RSS baseline is the highest RSS during the first 30% of requests, as the benchmark
takes it: the allocators' high-water marks still rise for a while after the first batches
(the engine core levels off after ~3,000 requests, docs/reliability.md) and a step's
transient buffers come and go, while a per-request leak keeps growing through the last 70%."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))

from soak import run_soak  # noqa: E402


def test_soak_300_requests():
    r = run_soak(300, concurrency=24, seed=1, serve_flags=[], progress=False, warmup=0.3)
    out = r.report.outcomes
    assert out["malformed"] == 0, "\n".join(r.report.problems)
    # the mix exercised each kind of client
    assert out["complete"] >= 150 and out["disconnected"] >= 30
    assert out["timed_out"] + out["complete_before_timeout"] >= 15
    assert not any(r.left.values()), f"the server still holds {r.left}"
    for name, growth in zip(("frontend", "engine core"), r.growth):
        assert growth <= 0.10, f"{name} RSS grew {growth:.1%} after the warm-up"
