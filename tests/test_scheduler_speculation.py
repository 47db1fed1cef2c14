"""Speculative decoding in the scheduler: decode entries of 1 + k positions, the lookahead
blocks they take and give back, rollback of rejected guesses, stops inside an accepted run,
and the guess planner's choices (tidal/core/speculation.py)."""

from __future__ import annotations

import random

import pytest

from tidal.core import (CacheConfig, KVCacheManager, LearnedStepTime, ModelOutput, Request,
                        SamplingParams, Scheduler, SchedulerConfig, StepShape)
from tidal.core.budget import StepBudget, StepPlan
from tidal.core.step_sizing import StepTarget
from tidal.core.speculation import (GUESS_FIXED_PENALTY, GuessPlanner, acceptance,
                                    expected_tokens, record_verification)

EOS = 2


class RowCost:
    """A step costs `fixed` seconds plus `per_row` a decode row (a memory-bound step grows
    slowly with its rows, until the rows' compute dominates)."""

    def __init__(self, fixed: float, per_row: float) -> None:
        self.fixed, self.per_row = fixed, per_row

    def shape_time(self, shape: StepShape) -> float:
        return self.fixed + self.per_row * shape.tokens if shape.seqs else 0.0


def sched(guesses: int = 4, adaptive: bool = False, num_blocks: int = 64, block_size: int = 4,
          step_time=None, **kw) -> Scheduler:
    cfg = SchedulerConfig(num_speculative_tokens=guesses, speculative_adaptive=adaptive,
                          max_model_len=512, **kw)
    return Scheduler(cfg, KVCacheManager(CacheConfig(num_blocks, block_size)), step_time)


def add(s: Scheduler, rid: str, prompt_len: int = 6, max_tokens: int = 32, **params) -> Request:
    r = Request(rid, list(range(10, 10 + prompt_len)),
                SamplingParams(max_tokens=max_tokens, **params), eos_token_ids=(EOS,))
    s.add_request(r)
    return r


def step(s: Scheduler, sampled: dict, proposed: dict | None = None, drafted=None):
    out = s.schedule()
    s.check_invariants()
    outputs = s.update(out, ModelOutput(sampled=sampled, proposed=proposed or {},
                                        drafted=drafted or {}))
    s.check_invariants()
    return out, outputs


def prefilled(s: Scheduler, rid: str, proposed: int = 4, **kw) -> Request:
    r = add(s, rid, **kw)
    step(s, {rid: [100]}, {rid: proposed})
    return r


def test_a_decode_guesses_what_its_proposer_holds_and_accepted_guesses_join_the_request():
    s = sched(guesses=4)
    r = prefilled(s, "a", proposed=3)
    out = s.schedule()
    (x,) = out.scheduled
    assert (x.num_new_tokens, x.num_computed_tokens, x.is_prefill) == (4, 6, False)
    assert r.num_computed_tokens == 10 and r.num_guesses == 3
    assert len(x.block_ids) * 4 >= 10  # the lookahead positions have slots
    outputs = s.update(out, ModelOutput(sampled={"a": [101, 102, 103, 104]},
                                        proposed={"a": 2}))
    s.check_invariants()
    assert outputs[0].new_token_ids == [101, 102, 103, 104]
    assert r.output_token_ids == [100, 101, 102, 103, 104]
    assert r.num_computed_tokens == r.num_tokens - 1 == 10
    assert (r.num_guesses, r.num_proposed) == (0, 2)
    assert (s.spec.drafted_tokens, s.spec.accepted_tokens, s.spec.verifications) == (3, 3, 1)


def test_rejected_guesses_roll_back_and_their_blocks_return():
    s = sched(guesses=8, block_size=4)
    r = prefilled(s, "a", proposed=8)  # 6 prompt tokens + 1: blocks for 7 tokens, 2 blocks
    free_before = s.kv.num_free
    out = s.schedule()
    assert out.scheduled[0].num_new_tokens == 9  # positions 6..14: 4 blocks
    assert s.kv.num_free == free_before - 2
    s.update(out, ModelOutput(sampled={"a": [101]}, drafted={"a": 8}))  # the first is wrong
    s.check_invariants()
    assert r.output_token_ids == [100, 101] and r.num_computed_tokens == 7
    assert len(s.kv.tables["a"]) == 2 and s.kv.num_free == free_before
    assert (s.spec.drafted_tokens, s.spec.accepted_tokens) == (8, 0)
    r.num_proposed = 8  # one rejection, no hit, on a proposal of 8
    assert acceptance(r) < 0.5


def test_a_stop_token_inside_an_accepted_run_ends_the_request_there():
    s = sched(guesses=4)
    prefilled(s, "a", proposed=4)
    _, outputs = step(s, {"a": [101, EOS, 103, 104, 105]})
    assert outputs[0].new_token_ids == [101, EOS]
    assert outputs[0].finish_reason == "stop"
    assert "a" not in s.requests and s.kv.num_free == s.kv.num_blocks


def test_guesses_never_run_past_max_tokens():
    s = sched(guesses=8)
    prefilled(s, "a", proposed=8, max_tokens=4)  # one token out, three to go
    out, outputs = step(s, {"a": [101, 102, 103]})
    assert out.scheduled[0].num_new_tokens == 3  # two guesses and the model's own token
    assert outputs[0].finish_reason == "length"
    assert outputs[0].new_token_ids == [101, 102, 103]


def test_guesses_spend_the_step_budget_and_only_spare_blocks():
    s = sched(guesses=8, num_blocks=4, block_size=4, max_input_tokens_per_step=16,
              chunked_prefill_size=16)
    prefilled(s, "a", proposed=8)  # 2 blocks held, 2 free: 8 spare slots... and 1 used
    out = s.schedule()
    s.check_invariants()
    # blocks cover positions 6..14 at most (4 blocks of 4 = 16 slots), so up to 8 guesses
    # fit in memory; the budget of 16 tokens less the decode leaves 15
    assert out.scheduled[0].num_new_tokens == 9
    s.update(out, ModelOutput(sampled={"a": [101]}))
    t = sched(guesses=8, num_blocks=3, block_size=4)
    prefilled(t, "b", proposed=8)  # 2 of 3 blocks held: room for 1 + 5 positions at most
    out = t.schedule()
    assert out.scheduled[0].num_new_tokens == 1  # 8 guesses do not fit: none are taken
    t.check_invariants()


def test_guesses_take_only_the_budget_that_waiting_prompts_leave():
    s = sched(guesses=8, max_input_tokens_per_step=16, chunked_prefill_size=16)
    prefilled(s, "a", proposed=8)
    s.add_request(Request("b", list(range(500, 512)), SamplingParams(max_tokens=8),
                          eos_token_ids=(EOS,)))  # 12 of the 15 tokens left after a's decode
    out = s.schedule()
    s.check_invariants()
    got = {x.request_id: x.num_new_tokens for x in out.scheduled}
    assert got == {"a": 1 + 3, "b": 12}  # the prompt first; guesses the 3 it leaves
    s.update(out, ModelOutput(sampled={"a": [101, 102], "b": [200]}, proposed={"a": 8}))
    add(s, "c", prompt_len=40)  # more than the whole step: nobody guesses
    out = s.schedule()
    s.check_invariants()
    assert all(x.num_new_tokens == 1 for x in out.scheduled if not x.is_prefill)
    assert sum(x.num_new_tokens for x in out.scheduled if x.is_prefill) > 0


def test_guesses_follow_what_the_proposer_holds():
    s = sched(guesses=4)
    prefilled(s, "a", proposed=0)
    assert s.schedule().scheduled[0].num_new_tokens == 1  # nothing to guess


def test_a_retraction_during_a_verification_drops_its_tokens_and_guesses():
    s = sched(guesses=4, num_blocks=6, block_size=4, async_scheduling=True)
    r = add(s, "a", prompt_len=6)
    out = s.schedule()
    s.update(out, ModelOutput(sampled={"a": [100]}, proposed={"a": 4}))
    out = s.schedule()
    assert out.scheduled[0].num_new_tokens == 5 and r.num_guesses == 4
    later = s.schedule()  # planned while the verification runs: it retracts the request
    assert later.scheduled == []
    s.retract(StepPlan(later, StepBudget(16, 16, 4), 8), r)
    s.check_invariants()
    assert r.num_guesses == 0 and "a" not in s.kv.tables
    s.update(out, ModelOutput(sampled={"a": [101, 102]}, preempted_ack=["a"]))
    s.check_invariants()
    assert r.output_token_ids == [100]  # the verification's tokens are dropped
    assert s.kv.num_free == s.kv.num_blocks


def test_with_async_scheduling_a_verifying_request_sits_out_the_next_plan():
    s = sched(guesses=4, async_scheduling=True)
    add(s, "a")
    first = s.schedule()  # prefill
    second = s.schedule()  # its first decode, planned before the prefill's token is known
    s.update(first, ModelOutput(sampled={"a": [100]}, proposed={"a": 4}))
    assert second.scheduled[0].num_new_tokens == 1
    third = s.schedule()  # the proposer's guesses are known now
    assert third.scheduled[0].num_new_tokens == 5
    s.update(second, ModelOutput(sampled={"a": [101]}, proposed={"a": 4}))
    fourth = s.schedule()  # the verification is in flight: its position is unknown
    assert fourth.scheduled == []
    s.update(third, ModelOutput(sampled={"a": [102, 103]}, drafted={"a": 4}))
    s.check_invariants()
    r = s.requests["a"]
    assert r.output_token_ids == [100, 101, 102, 103] and r.num_computed_tokens == 9
    s.update(fourth, ModelOutput())
    fifth = s.schedule()
    assert fifth.scheduled[0].num_computed_tokens == 9


def test_acceptance_estimate_follows_verifications():
    r = Request("a", [1], SamplingParams())
    assert acceptance(r) == 0.5
    for _ in range(20):
        record_verification(r, guessed=4, accepted=4)
    assert acceptance(r) > 0.9
    for _ in range(40):
        record_verification(r, guessed=4, accepted=0)
    assert acceptance(r) < 0.2
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)
    assert expected_tokens(1.0, 3) == 4


def test_the_prior_is_learned_per_proposal_length():
    """The engine's verifications set a request's prior, by how many guesses its proposer
    held: long proposals that pass and short ones that fail make a request with a long
    proposal guess on where one with a short proposal does not."""
    planner = GuessPlanner(4, True, None)
    long_, short = Request("l", [1], SamplingParams()), Request("s", [1], SamplingParams())
    long_.num_proposed, short.num_proposed = 4, 1
    assert planner.prior(long_) == planner.prior(short) == 0.5
    for _ in range(50):
        planner.record(long_, guessed=4, accepted=4)
        planner.record(short, guessed=1, accepted=0)
    assert planner.prior(long_) > 0.95 and planner.prior(short) < 0.05
    fresh = Request("b", [1], SamplingParams())
    fresh.num_proposed = 1
    assert planner.alpha(fresh) == 0.5  # it tries once, whatever others did
    record_verification(fresh, guessed=1, accepted=0)
    assert planner.alpha(fresh) < 0.1
    fresh.num_proposed = 4  # its proposer now holds a long match
    assert planner.alpha(fresh) > 0.6


def test_a_requests_own_record_is_kept_per_proposal_length():
    """A request whose short proposals fail and whose long ones pass (a suffix proposer's
    short and long matches) is expected to pass on a long one and fail on a short one, even
    where the engine knows nothing yet: one mixed record would put both near even."""
    planner = GuessPlanner(8, True, None)
    r = Request("a", [1], SamplingParams())
    for _ in range(10):
        r.num_proposed = 2
        record_verification(r, guessed=2, accepted=0)
        r.num_proposed = 8
        record_verification(r, guessed=8, accepted=8)
    assert planner.prior(r) == 0.5  # the engine's counts are untouched
    assert planner.alpha(r) > 0.9
    r.num_proposed = 2
    assert planner.alpha(r) < 0.25
    r.num_proposed = 5  # a length it never verified: at least even
    assert planner.alpha(r) == 0.5


def _decoding(n: int, alpha_hits: float) -> list[tuple[Request, int]]:
    out = []
    for i in range(n):
        r = Request(f"r{i}", [1] * 8, SamplingParams(max_tokens=100))
        r.output_token_ids = [3]
        r.num_proposed = 4
        r.spec_counts[4] = [alpha_hits, 0.0]
        out.append((r, 8))
    return out


def test_adaptive_guesses_at_one_request_and_turns_itself_off_at_large_batches():
    memory_bound = RowCost(fixed=0.010, per_row=0.0001)
    planner = GuessPlanner(4, True, memory_bound)
    assert planner.choose(_decoding(1, alpha_hits=8.0), budget=100) == [4]
    many = planner.choose(_decoding(1024, alpha_hits=8.0), budget=10_000)
    assert sum(many) == 0
    # and the runner is not asked to guess ahead where no guess could pay
    assert planner.worth_proposing(_decoding(1, alpha_hits=8.0))
    assert not planner.worth_proposing(_decoding(1024, alpha_hits=8.0))
    # a request whose guesses are rarely accepted guesses less than one that is
    mixed = _decoding(2, alpha_hits=8.0)
    mixed[1][0].spec_counts[4] = [0.0, 30.0]
    k_good, k_bad = GuessPlanner(4, True, RowCost(0.001, 0.0003)).choose(mixed, budget=100)
    assert k_good > k_bad
    # before the model predicts anything, every other step guesses one request's cap in
    # all: a large batch does not grow to many times its rows while the model learns what a
    # row costs, and the model sees steps of two sizes
    unknown = GuessPlanner(4, True, RowCost(0.0, 0.0))
    assert [unknown.choose(_decoding(3, 0.0), 100) for _ in range(3)] == [[4, 0, 0], [0] * 3,
                                                                          [4, 0, 0]]
    # not adaptive: every request guesses its cap
    assert GuessPlanner(4, False, memory_bound).choose(_decoding(3, 0.0), 100) == [4] * 3


def test_a_request_whose_short_proposals_failed_still_proposes_for_long_ones():
    """Whether the runner proposes ahead is decided before the proposer holds anything. A
    request whose two-guess proposals kept failing must still be asked: the engine's long
    proposals pass, and the planner prices the next proposal by its length (suffix decoding
    on chat prompts one at a time had stopped proposing for good, at 0.91x of no
    speculation). Where no guess of any length could pay, nobody proposes."""
    planner = GuessPlanner(8, True, RowCost(fixed=0.008, per_row=0.003))
    other = Request("o", [1], SamplingParams())
    for _ in range(30):
        other.num_proposed = 8
        planner.record(other, guessed=8, accepted=8)
        other.num_proposed = 2
        planner.record(other, guessed=2, accepted=0)
    entries = _decoding(1, alpha_hits=0.0)
    r = entries[0][0]
    r.num_proposed = 2
    for _ in range(10):
        planner.record(r, guessed=2, accepted=0)
    assert planner.alpha(r) < 0.1 and planner.choose(entries, budget=100) == [0]
    assert planner.worth_proposing(entries)
    r.num_proposed = 8  # asked, its proposer now holds a long match: it guesses
    assert planner.choose(entries, budget=100)[0] >= 1
    assert not GuessPlanner(8, True, RowCost(fixed=0.008, per_row=0.009)).worth_proposing(
        entries)


def _learned(penalty: float, rows: list[int], fixed: float, per_row: float,
             noise: float, steps: int = 40) -> LearnedStepTime:
    """A learned model of the planner's kind after `steps` decode steps of the given sizes
    (in turn, contexts at random), each `fixed` + `per_row` a row with a relative gaussian
    error of `noise`."""
    model, rng = LearnedStepTime(fixed_penalty=penalty), random.Random(0)
    for i in range(steps):
        n = rows[i % len(rows)]
        model.observe(StepShape((1, rng.randint(8, 600), True) for _ in range(n)),
                      (fixed + per_row * n) * (1 + rng.gauss(0, noise)))
    return model


def test_steps_of_one_size_price_a_guess_at_the_average_row():
    """A large batch's first steps, all of one size, cannot tell a fixed cost from the
    rows'. Without the preference for a small fixed cost, the fit split the time (a fixed
    169 ms, rows at 1.3 ms where they cost 3.4) and all 64 requests guessed. The planner's
    model does not price a row from steps of one size (it predicts nothing, and the planner
    probes with one request's guesses every other step); at steps of two sizes it finds a
    row's cost, and 64 requests do not guess. Steps of 1 and 16 rows still find the fixed
    cost, so one request still guesses."""
    def row(model, n):
        return (model.shape_time(StepShape([(1, 300, True)] * (n + 1)))
                - model.shape_time(StepShape([(1, 300, True)] * n)))

    high = _decoding(64, alpha_hits=20.0)
    one_size = _learned(GUESS_FIXED_PENALTY, [79], 0.006, 0.0034, 0.0)
    assert one_size.shape_time(StepShape([(1, 300, True)] * 79)) == 0.0
    probing = GuessPlanner(4, True, one_size)
    assert [sum(probing.choose(high, budget=10_000)) for _ in range(2)] == [4, 0]
    split = _learned(0.0, [79], 0.006, 0.0034, 0.0)
    assert row(split, 79) < 0.5 * 0.0034
    assert sum(GuessPlanner(4, True, split).choose(high, budget=10_000)) == 64 * 4
    narrow = _learned(GUESS_FIXED_PENALTY, [64, 79], 0.006, 0.0034, 0.08)
    assert 0.85 * 0.0034 < row(narrow, 64) < 1.15 * 0.0034
    assert sum(GuessPlanner(4, True, narrow).choose(high, budget=10_000)) == 0
    small = _learned(GUESS_FIXED_PENALTY, [1, 16], 0.006, 0.0025, 0.05)
    assert small.coef[0] == pytest.approx(0.006, rel=0.15)
    assert GuessPlanner(4, True, small).choose(_decoding(1, alpha_hits=8.0), 100)[0] >= 2


def test_verifications_aged_out_of_the_fit_leave_a_row_unpriced_not_dear():
    """One request: once its verifications weigh less than the fixed cost's pseudo-step,
    the fit priced one more row at the whole step, so nothing paid, no verification came to
    correct it, and guessing stopped for hundreds of steps. Then the model predicts nothing
    and the planner probes, as before its first fit."""
    model, rng = LearnedStepTime(fixed_penalty=GUESS_FIXED_PENALTY), random.Random(0)

    def steps(count: int, sizes: list[int]) -> None:
        for i in range(count):
            n = sizes[i % len(sizes)]
            model.observe(StepShape((1, 300 + i, True) for _ in range(n)),
                          (0.006 + 0.0025 * n) * (1 + rng.gauss(0, 0.03)))

    one_row = StepShape([(1, 300, True)])
    steps(40, [1, 4])
    row = model.shape_time(one_row.copy().add(1, 301)) - model.shape_time(one_row)
    assert 0.8 * 0.0025 < row < 1.2 * 0.0025
    planner, entries = GuessPlanner(4, True, model), _decoding(1, alpha_hits=8.0)
    assert planner.choose(entries, budget=100)[0] >= 2
    steps(400, [1])  # no guesses for a while: the 4-row steps age out of the fit
    assert model.shape_time(one_row) == 0.0
    assert [planner.choose(entries, budget=100)[0] for _ in range(2)] == [4, 0]


def test_adaptive_guesses_keep_tpot_targets():
    """A request that cannot guess pays for the others' guesses in step time: with a TPOT
    target they stop where its time per token would pass it."""
    cost = RowCost(fixed=0.010, per_row=0.001)
    entries = _decoding(2, alpha_hits=6.0)
    entries[1][0].num_proposed = 0
    free = GuessPlanner(4, True, cost).choose(entries, budget=100)
    strict = GuessPlanner(4, True, cost, tpot=lambda r: 0.0125).choose(entries, budget=100)
    assert free == [4, 0] and strict == [0, 0]


def test_adaptive_guesses_keep_the_step_within_its_target():
    """Guesses that pay for their rows still stop where the step would pass its target:
    11 ms for the one row, 1 ms a guess, a 12.5 ms target: one guess."""
    cost = RowCost(fixed=0.010, per_row=0.001)
    entries = _decoding(1, alpha_hits=8.0)
    assert GuessPlanner(4, True, cost).choose(entries, budget=100) == [4]
    assert GuessPlanner(4, True, cost, target=StepTarget(0.0125)).choose(entries, budget=100) == [1]
