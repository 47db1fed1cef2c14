"""The `slo` policy on hand-computed cases: admission order by deadline with Moore-Hodgson's
rule for who gives way, defer vs reject under overload, the starvation bound, step sizing by
the tightest TPOT target; and the online step-time model."""

from __future__ import annotations

import random

import pytest

from tidal.core import (LearnedStepTime, ModelOutput, Request, SamplingParams, SchedulerConfig,
                        StepShape)

from conftest import make_scheduler, scheduled, step


class Linear:
    """seconds = fixed + per_token * tokens (+ per_seq * seqs)."""

    def __init__(self, fixed: float = 0.0, per_token: float = 0.0, per_seq: float = 0.0):
        self.fixed, self.per_token, self.per_seq = fixed, per_token, per_seq

    def shape_time(self, shape: StepShape) -> float:
        if not shape.seqs:
            return 0.0
        return self.fixed + self.per_token * shape.tokens + self.per_seq * shape.seqs


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def slo_scheduler(model, clock=None, block_size: int = 16, **config):
    config.setdefault("slo_step_headroom", 1.0)  # the cases' arithmetic sizes to the target
    return make_scheduler(num_blocks=2000, block_size=block_size, policy="slo",
                          step_time=model, clock=clock or Clock(), **config)


def add(s, rid: str, prompt_len: int, arrival: float = 0.0, max_tokens: int = 8, **params):
    prompt = [1000 * (len(s.requests) + 1) + i for i in range(prompt_len)]  # no shared prefix
    r = Request(rid, prompt, SamplingParams(max_tokens=max_tokens, **params),
                arrival_time=arrival)
    s.add_request(r)
    return r


def _moore_hodgson_queue(s):
    """1,000 prompt tokens a second. By deadline: a (500 tokens, due 1.0 s) ends at 0.5,
    b (600, 1.2) at 1.1, c (200, 1.3) at 1.3, d (400, 1.4) would end at 1.7: late, so the
    longest so far, b, gives way and d ends at 1.1. e has no TTFT target."""
    add(s, "e", 100)
    add(s, "b", 600, ttft_slo_ms=1200)
    add(s, "d", 400, ttft_slo_ms=1400)
    add(s, "a", 500, ttft_slo_ms=1000)
    add(s, "c", 200, ttft_slo_ms=1300)


def test_admission_by_deadline_where_the_longest_gives_way_and_is_deferred():
    s = slo_scheduler(Linear(per_token=1e-3))
    _moore_hodgson_queue(s)
    out, outputs = step(s)
    assert [x.request_id for x in out.scheduled] == ["a", "c", "d", "e", "b"]
    assert not any(o.finished for o in outputs)


def test_under_reject_the_late_request_is_refused_before_any_compute():
    s = slo_scheduler(Linear(per_token=1e-3), slo_overload="reject")
    _moore_hodgson_queue(s)
    out, outputs = step(s)
    assert [x.request_id for x in out.scheduled] == ["a", "c", "d", "e"]
    (rejected,) = [o for o in outputs if o.finished]
    assert rejected.request_id == "b" and rejected.finish_reason == "rejected"
    assert rejected.new_token_ids == [] and "1200 ms" in rejected.finish_message
    assert "b" not in s.requests and "b" not in s.kv.tables


def test_a_request_admitted_once_is_never_rejected_and_resumes_first():
    s = slo_scheduler(Linear(per_token=1e-3), slo_overload="reject")
    late = add(s, "late", 600, ttft_slo_ms=100)
    late.admitted = True  # as a retracted request is: back in the queue, blocks freed
    add(s, "a", 100, ttft_slo_ms=1000)
    out, outputs = step(s)
    assert [x.request_id for x in out.scheduled] == ["late", "a"]
    assert not any(o.finished for o in outputs)


def test_a_deferred_request_goes_first_once_it_waited_slo_max_defer_ms():
    clock = Clock()
    s = slo_scheduler(Linear(per_token=1e-3), clock, slo_max_defer_ms=2000)
    add(s, "hopeless", 600, arrival=0.0, ttft_slo_ms=100)  # 0.6 s of prefill, due at 0.1 s
    add(s, "fresh", 100, arrival=0.9, ttft_slo_ms=1000)
    clock.now = 1.0
    assert [r.request_id for r in s.policy.triage(s, 1000.0)] == ["fresh", "hopeless"]
    clock.now = 2.0  # hopeless has waited 2 s
    assert [r.request_id for r in s.policy.triage(s, 1000.0)] == ["hopeless", "fresh"]


def _decoding(s, count: int, tpot_ms: float) -> None:
    """`count` requests past their prefill, decoding with a TPOT target."""
    for i in range(count):
        add(s, f"d{i}", 4, max_tokens=100, tpot_slo_ms=tpot_ms)
    step(s)
    assert len(s.running) == count and not any(r.is_prefilling for r in s.running)


def test_the_prefill_chunk_keeps_the_step_within_the_tightest_tpot():
    """5 ms a step + 0.1 ms a token: 10 decodes and T prefill tokens take
    5 + 0.1 * (10 + T) ms, within 20 ms for T <= 140, so the chunk is 128 (8 blocks)."""
    s = slo_scheduler(Linear(fixed=5e-3, per_token=1e-4))
    _decoding(s, 10, tpot_ms=20)
    add(s, "long", 2000, ttft_slo_ms=60_000)
    out, _ = step(s)
    assert scheduled(out)["long"] == (128, 0)
    out, _ = step(s)
    assert scheduled(out)["long"] == (128, 128)


def test_headroom_sizes_steps_to_a_share_of_the_tpot_target():
    """Half of the 20 ms target: 5 + 0.1 * (10 + T) <= 10 for T <= 40, so 32 (2 blocks)."""
    s = slo_scheduler(Linear(fixed=5e-3, per_token=1e-4), slo_step_headroom=0.5)
    _decoding(s, 10, tpot_ms=20)
    add(s, "long", 2000, ttft_slo_ms=60_000)
    out, _ = step(s)
    assert scheduled(out)["long"] == (32, 0)


def test_without_tpot_targets_the_step_takes_the_whole_budget():
    s = slo_scheduler(Linear(fixed=5e-3, per_token=1e-4), chunked_prefill_size=512)
    _decoding(s, 10, tpot_ms=None)
    add(s, "long", 2000)
    out, _ = step(s)
    assert scheduled(out)["long"] == (512, 0)


def test_admission_stops_where_the_decode_batch_would_break_the_tpot_target():
    """1 ms a token: 2 decodes + k new ones + a 16-token block take 18 + k ms, within 20 ms
    for k <= 2, so only two of five short requests are admitted this step."""
    s = slo_scheduler(Linear(per_token=1e-3))
    _decoding(s, 2, tpot_ms=20)
    for i in range(5):
        add(s, f"n{i}", 2, ttft_slo_ms=60_000)
    out, _ = step(s)
    assert [rid for rid in scheduled(out) if rid.startswith("n")] == ["n0", "n1"]


def test_decodes_already_at_the_target_admit_no_one_new():
    """One decode beside a block takes 5 + 0.1 * 17 = 6.7 ms, within 7 ms; ten take 7.6."""
    s = slo_scheduler(Linear(fixed=5e-3, per_token=1e-4))
    _decoding(s, 10, tpot_ms=7)
    add(s, "long", 2000)
    out, _ = step(s)
    assert "long" not in scheduled(out) and len(out.scheduled) == 10


def test_a_target_no_batch_can_meet_caps_nothing():
    """5 ms: even one decode beside a block takes 6.7 ms, so the target cannot be kept by
    sizing steps; the step takes the whole budget rather than starving prompts."""
    s = slo_scheduler(Linear(fixed=5e-3, per_token=1e-4))
    _decoding(s, 10, tpot_ms=5)
    add(s, "long", 2000)
    out, _ = step(s)
    assert scheduled(out)["long"] == (2000, 0)


def test_the_slo_policy_needs_a_step_time_model_and_valid_settings():
    with pytest.raises(ValueError, match="needs a step-time model"):
        make_scheduler(policy="slo")
    with pytest.raises(ValueError, match="slo_overload must be one of defer, reject"):
        SchedulerConfig.from_kwargs(policy="slo", slo_overload="drop")
    with pytest.raises(ValueError, match="ttft_slo_ms must be > 0"):
        SchedulerConfig.from_kwargs(policy="slo", ttft_slo_ms=0)
    with pytest.raises(ValueError, match="slo_max_defer_ms must be > 0"):
        SchedulerConfig(policy="slo", policy_options={"slo_max_defer_ms": -1})
    with pytest.raises(ValueError, match="tpot_slo_ms must be > 0"):
        SamplingParams(tpot_slo_ms=-1)


def _shape(rng: random.Random) -> StepShape:
    shape = StepShape()
    for _ in range(rng.randint(1, 32)):
        shape.add(1, rng.randint(1, 2000))
    if rng.random() < 0.5:
        shape.add(rng.randint(16, 2048), rng.choice([0, 512]))
    return shape


def test_the_learned_step_time_recovers_a_linear_truth():
    truth = Linear(fixed=2e-3, per_token=3e-5, per_seq=1e-4)
    model, rng = LearnedStepTime(), random.Random(0)
    assert model.shape_time(_shape(rng)) == 0.0  # nothing seen yet
    for _ in range(200):
        shape = _shape(rng)
        model.observe(shape, truth.shape_time(shape))
    for _ in range(20):
        shape = _shape(rng)
        assert model.shape_time(shape) == pytest.approx(truth.shape_time(shape), rel=0.01)
    assert all(c >= 0 for c in model.coef)


def test_the_learned_step_time_does_not_extrapolate_from_decodes_alone():
    """A first prompt step slowed by warm-up and a few decodes would give a per-token slope
    of seconds; until enough prompt steps are seen the token terms stay out of the fit, so a
    long prompt is predicted near a decode step rather than minutes."""
    model = LearnedStepTime()
    model.observe(StepShape([(2, 0, True)]), 0.070)
    for c in range(2, 12):
        model.observe(StepShape([(1, c, True)]), 0.045)
    long_prompt = StepShape([(128, 0, True)] * 20)
    assert 0.04 < model.shape_time(long_prompt) < 0.1


def test_the_learned_step_time_follows_a_machine_that_slows_down():
    model, rng = LearnedStepTime(half_life=32), random.Random(1)
    for truth in (Linear(fixed=1e-3, per_token=1e-5), Linear(fixed=2e-3, per_token=2e-5)):
        for _ in range(300):
            shape = _shape(rng)
            model.observe(shape, truth.shape_time(shape))
    shape = _shape(rng)
    assert model.shape_time(shape) == pytest.approx(truth.shape_time(shape), rel=0.02)


def test_rejections_reach_the_executor_as_finished():
    """A rejected request was never announced to the executor; its id is still reported
    finished once, like any other (an executor ignores ids it does not know)."""
    s = slo_scheduler(Linear(per_token=1e-3), slo_overload="reject")
    add(s, "late", 600, ttft_slo_ms=100)
    out = s.schedule()
    assert not out.scheduled and not out.new_requests
    (o,) = s.update(out, ModelOutput())
    assert o.finish_reason == "rejected" and o.finished
    assert s.schedule().finished_ids == ["late"]
