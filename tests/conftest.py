"""Shared helpers: build a scheduler on a tiny pool and run steps with chosen tokens."""

from __future__ import annotations

import itertools
import os

from hypothesis import HealthCheck, settings

from tidal.core import (CacheConfig, KVCacheManager, ModelOutput, Request, SamplingParams,
                        Scheduler, SchedulerConfig)

settings.register_profile("default", max_examples=250, stateful_step_count=50, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("long", max_examples=2000, stateful_step_count=120, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))

EOS = 2
_fresh = itertools.count(1)


def make_scheduler(num_blocks: int = 64, block_size: int = 4, step_time=None, clock=None,
                   **kwargs) -> Scheduler:
    kv = KVCacheManager(CacheConfig(num_blocks=num_blocks, block_size=block_size))
    extra = {"clock": clock} if clock is not None else {}
    return Scheduler(SchedulerConfig.from_kwargs(**kwargs), kv, step_time=step_time, **extra)


def add(sched: Scheduler, rid: str, prompt, max_tokens: int = 16, **params) -> Request:
    if isinstance(prompt, int):  # a prompt of that length sharing no prefix with others
        base = 1000 * next(_fresh)
        prompt = [base + i for i in range(prompt)]
    req = Request(rid, list(prompt), SamplingParams(max_tokens=max_tokens, **params),
                  arrival_time=float(len(sched.requests)), eos_token_ids=(EOS,))
    sched.add_request(req)
    return req


def sampled_for(sched: Scheduler, out, token: int = 7) -> dict[str, list[int]]:
    """One token per sampling request (n tokens for an n>1 request's first sample)."""
    sampled = {}
    for s in out.scheduled:
        if not s.samples or s.request_id not in sched.requests:
            continue
        r = sched.requests[s.request_id]
        n = r.sampling_params.n if r.fork_pending else 1
        sampled[s.request_id] = [token] * n
    return sampled


def step(sched: Scheduler, token: int = 7):
    """One synchronous step; checks the invariants on both sides of update()."""
    out = sched.schedule()
    sched.check_invariants()
    outputs = sched.update(out, ModelOutput(sampled=sampled_for(sched, out, token)))
    sched.check_invariants()
    return out, outputs


def scheduled(out) -> dict[str, tuple[int, int]]:
    """request_id -> (num_new_tokens, num_computed_tokens)."""
    return {s.request_id: (s.num_new_tokens, s.num_computed_tokens) for s in out.scheduled}
