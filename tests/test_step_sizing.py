"""Steps sized by time (`max_step_ms`) under every policy, with made-up step-time models
(pure core, no torch); the step-time model seeded by a start-up profile; the log of its
prediction error."""

from __future__ import annotations

import math

import pytest

from tidal.core import (STEP_TIME_TERMS, CacheConfig, KVCacheManager, LearnedStepTime,
                        LinearStepTime, PredictionLog, Scheduler, SchedulerConfig, StepShape)
from tidal.core.policies import POLICIES
from tidal.core.step_sizing import (CPU_MAX_STEP_MS, EFFICIENT_CHUNK, StepTarget,
                                   default_step_target)

from conftest import add, make_scheduler, scheduled, step


class Linear:
    """seconds = fixed + per_token * tokens: a step's prompt pieces cost what their tokens
    do, so the sizer's estimate of a step is exact."""

    def __init__(self, fixed: float, per_token: float) -> None:
        self.fixed, self.per_token = fixed, per_token

    def shape_time(self, shape: StepShape) -> float:
        return self.fixed + self.per_token * shape.tokens if shape.seqs else 0.0


MODEL = Linear(fixed=0.010, per_token=0.001)  # 10 ms a step, 1 ms a token


def sized(policy: str = "fcfs", max_step_ms: float | None = 100.0, **config):
    return make_scheduler(num_blocks=4000, block_size=16, step_time=MODEL,
                          policy=policy, max_step_ms=max_step_ms, **config)


def prompt_tokens(out) -> int:
    return sum(x.num_new_tokens for x in out.scheduled if x.is_prefill)


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_a_long_prompt_is_cut_to_the_chunks_that_fit_the_step_target(policy):
    """100 ms at 10 ms + 1 ms a token holds 90 tokens: block-aligned chunks of 80 (a prompt
    alone held to the target, too)."""
    s = sized(policy, lone_prompt_fixed_share=0.0)
    add(s, "a", 1000)
    chunks = []
    while "a" in s.requests and not s.requests["a"].output_token_ids:
        out, _ = step(s)
        chunks.append(prompt_tokens(out))
        assert MODEL.shape_time(StepShape.of(out)) <= 0.100
    assert chunks == [80] * 12 + [40]


def test_a_prompt_alone_takes_steps_that_pay_their_fixed_cost_once_a_tenth():
    """At 50 ms + 1 ms a token, a one-token prompt's step takes 51 ms: alone, with a fixed
    share of a tenth, a prompt's steps may take 510 ms (chunks of 448 tokens, past the 100 ms
    target), as nothing waits on them. A second prompt, or a stream decoding, brings the
    step back to the target."""
    model = Linear(fixed=0.050, per_token=0.001)
    s = make_scheduler(num_blocks=4000, block_size=16, step_time=model, max_step_ms=100.0,
                       lone_prompt_fixed_share=0.1)
    add(s, "a", 1000)
    out, _ = step(s)
    assert prompt_tokens(out) == 448 and model.shape_time(StepShape.of(out)) <= 0.510
    add(s, "b", 1000)  # a second prompt: whoever comes first gets the earlier first token
    out, _ = step(s)
    assert prompt_tokens(out) == 48
    while s.requests["a"].is_prefilling or not s.requests["a"].output_token_ids:
        step(s)
    out, _ = step(s)  # "a" decodes: "b" alone to prefill, but a stream waits on the step
    assert sum(1 for x in out.scheduled if not x.is_prefill) == 1
    assert prompt_tokens(out) == 48
    background = make_scheduler(num_blocks=4000, block_size=16, step_time=model,
                                max_step_ms=400.0, lone_prompt_fixed_share=0.1)
    add(background, "c", 1000, background=True)  # a batch line alone: a share of the target
    out, _ = step(background)
    assert prompt_tokens(out) == 48


@pytest.mark.parametrize("policy", ["fcfs", "slo"])
def test_running_decodes_take_their_rows_off_the_prompt_tokens(policy):
    """Twenty streams decoding: 10 ms + 20 rows leave 70 ms, so 64 prompt tokens (4 blocks)
    join them, and every step keeps within the target."""
    s = sized(policy)
    for i in range(20):
        add(s, f"d{i}", 16, max_tokens=50)
    while any(r.is_prefilling or not r.output_token_ids for r in s.requests.values()):
        step(s)
    add(s, "long", 1000)
    out, _ = step(s)
    assert sum(1 for x in out.scheduled if not x.is_prefill) == 20
    assert prompt_tokens(out) == 64
    assert MODEL.shape_time(StepShape.of(out)) <= 0.100


def test_whole_prompts_keep_to_the_target_under_a_small_chunk_budget():
    """Twelve 10-token prompts need no chunk: the input budget is what caps them, even where
    the chunk budget is a single block (80 tokens fit 100 ms at 10 ms + 1 ms a token)."""
    s = sized(chunked_prefill_size=16)
    for i in range(12):
        add(s, f"p{i}", 10)
    out, _ = step(s)
    assert prompt_tokens(out) == 80
    assert MODEL.shape_time(StepShape.of(out)) <= 0.100


def test_decodes_over_the_target_still_let_one_block_of_prompt_through():
    """100 streams take 110 ms alone: the waiting prompt still moves, a block a step."""
    s = sized(max_num_seqs=200)
    for i in range(100):
        add(s, f"d{i}", 16, max_tokens=500)
    while any(not r.output_token_ids for r in s.requests.values()):
        step(s)
    add(s, "late", 200)
    out, _ = step(s)
    assert sum(1 for x in out.scheduled if not x.is_prefill) == 100
    assert prompt_tokens(out) == 16


@pytest.mark.parametrize("max_step_ms", [None, 0.0])
def test_without_a_target_only_the_token_budgets_cap_a_step(max_step_ms):
    s = sized(max_step_ms=max_step_ms, chunked_prefill_size=512)
    add(s, "a", 1000)
    out, _ = step(s)
    assert prompt_tokens(out) == 512


def test_a_burst_gets_first_tokens_step_by_step_not_all_in_one_step():
    """Forty 300-token prompts at once under a 400 ms target (at 10 ms + 1 ms a token): each
    step computes at most 390 tokens, so first tokens come over many steps, the first after
    one or two, and no step that streams wait on runs past the target."""
    s = sized(max_step_ms=400.0)
    for i in range(40):
        add(s, f"r{i}", 300, max_tokens=8)
    first: dict[str, int] = {}
    steps = 0
    while s.has_unfinished_requests():
        out, outputs = step(s)
        steps += 1
        assert MODEL.shape_time(StepShape.of(out)) <= 0.400
        for o in outputs:
            first.setdefault(o.request_id, steps)
    order = sorted(first.values())
    assert len(order) == 40 and order[0] <= 2 and order[-1] >= 30


def test_the_slo_policy_sizes_by_the_tighter_of_its_tpot_target_and_the_step_target():
    """TPOT 50 ms under a 100 ms step target: 50 ms - 10 ms - 1 decode row -> 32 tokens; a
    TPOT of 300 ms: the step target (80 tokens) binds."""
    for tpot, expected in ((50.0, 32), (300.0, 80)):
        s = sized("slo", tpot_slo_ms=tpot, slo_step_headroom=1.0)
        add(s, "stream", 16, max_tokens=100)
        step(s)
        add(s, "long", 1000)
        out, _ = step(s)
        assert prompt_tokens(out) == expected, tpot


def test_a_step_target_needs_a_step_time_model():
    with pytest.raises(ValueError, match="max_step_ms needs a step-time model"):
        make_scheduler(max_step_ms=100.0)
    with pytest.raises(ValueError, match="max_step_ms must be >= 0"):
        SchedulerConfig(max_step_ms=-1.0)


# ---------------------------------------------------------------- the step-time model


def _truth(shape: StepShape) -> float:
    """A machine: 8 ms a step, 1.2 ms a prompt token, 2 ms a decode row."""
    prompt = shape.tokens - shape.seqs
    return 0.008 + 0.0012 * prompt + 0.002 * shape.seqs


def _profile() -> list[tuple[StepShape, float]]:
    shapes = [StepShape().add(1, 256, count=b) for b in (1, 4, 16, 64)]
    shapes += [StepShape().add(n, 0) for n in (16, 64, 256, 512, 1024)]
    shapes += [StepShape().add(128, 0, count=4), StepShape().add(256, 768)]
    return [(s, _truth(s)) for s in shapes]


def test_a_profile_makes_the_model_right_before_its_first_step():
    fresh, seeded = LearnedStepTime(), LearnedStepTime(prior=_profile())
    chunk = StepShape().add(1, 300, count=10).add(300, 0)
    assert fresh.shape_time(chunk) == 0.0
    assert seeded.shape_time(chunk) == pytest.approx(_truth(chunk), rel=0.1)


def test_the_profile_still_prices_prompts_after_a_long_run_of_decodes():
    """1,000 steps of decodes alone fill the window, where tokens and rows are one feature:
    the profile keeps a prompt's price, which decodes alone would leave to chance."""
    model = LearnedStepTime(prior=_profile())
    for i in range(1000):
        decode = StepShape().add(1, 300 + i % 50, count=8 + i % 16)
        model.observe(decode, _truth(decode))
    prompt = StepShape().add(512, 0)
    assert model.shape_time(prompt) == pytest.approx(_truth(prompt), rel=0.15)


def test_served_steps_correct_a_profile_from_a_faster_machine():
    """The server runs 1.5x slower than its profile says: the fit follows the served steps."""
    model = LearnedStepTime(prior=_profile())
    for i in range(400):
        shape = StepShape().add(1, 300, count=8).add(64 + 16 * (i % 20), 0)
        model.observe(shape, 1.5 * _truth(shape))
    probe = StepShape().add(1, 300, count=8).add(200, 0)
    assert model.shape_time(probe) == pytest.approx(1.5 * _truth(probe), rel=0.1)


def test_the_prediction_log_gives_quantiles_of_predicted_over_measured():
    log = PredictionLog(window=100)
    assert log.quantiles(0.5, 0.99) == [0.0, 0.0]
    for i in range(200):  # the first 100 leave the window
        log.record(predicted=(1.0 if i < 100 else 0.5 + i / 200), measured=1.0)
    p50, p99 = log.quantiles(0.5, 0.99)
    assert p50 == pytest.approx(1.25, abs=0.01) and p99 == pytest.approx(1.495, abs=0.01)
    log.record(0.0, 1.0)  # no prediction: not an error of the model's
    assert len(log.ratios) == 100


def test_the_default_target_is_none_on_a_gpu_and_a_chunks_time_on_a_slow_cpu():
    """400 ms on a CPU that computes a 256-token chunk faster; that chunk's time on one
    slower (2 ms a token: 522 ms); none on a GPU, and none known without a model."""
    assert default_step_target(True, MODEL) == 0.0
    assert default_step_target(False, MODEL) == CPU_MAX_STEP_MS  # 266 ms a chunk
    assert default_step_target(False, Linear(0.010, 0.002)) == 522
    assert default_step_target(False, None) == CPU_MAX_STEP_MS


def test_a_target_that_follows_the_model_holds_a_chunk_until_it_prices_prompts():
    """A server that timed only decodes before serving: its steps hold one 256-token chunk
    of prompt while its model prices none (a 4k prompt would otherwise look free and take a
    single step of seconds); once served prompt steps teach the model, the target is that
    model's price of a chunk on this machine (twice `_truth`'s: 632 ms) and steps are
    sized to it (the prompt alone held to the target too)."""
    def machine(shape: StepShape) -> float:
        return 2 * _truth(shape)

    decodes = [(shape, machine(shape)) for shape, _ in _profile() if shape.tokens == shape.seqs]
    model = LearnedStepTime(prior=decodes)
    target = StepTarget(model=model)
    s = Scheduler(SchedulerConfig(lone_prompt_fixed_share=0.0),
                  KVCacheManager(CacheConfig(num_blocks=4000, block_size=16)),
                  step_time=model, step_target=target)
    assert target.seconds == CPU_MAX_STEP_MS / 1000 and target.prompt_cap == EFFICIENT_CHUNK
    add(s, "a", 4000, max_tokens=2)
    chunks, unpriced = [], []
    while not s.requests["a"].output_token_ids:
        unpriced.append(not model.prices_prompts)
        out, _ = step(s)
        chunks.append(prompt_tokens(out))
        model.observe(StepShape.of(out), machine(StepShape.of(out)))
    learned = unpriced.index(False)
    assert learned >= 8 and chunks[:learned] == [EFFICIENT_CHUNK] * learned
    assert target.seconds == pytest.approx(machine(StepShape().add(EFFICIENT_CHUNK, 0)),
                                           rel=0.05)
    assert target.prompt_cap == math.inf
    for n in chunks[learned:-1]:  # each chunk within the target, and not a block under it
        assert machine(StepShape().add(n, 0)) <= target.seconds * 1.05
        assert machine(StepShape().add(n + 16, 0)) > target.seconds * 0.95


def test_the_simulator_sizes_steps_as_the_engine_would_on_that_hardware():
    from tidal.sim.build import build_simulator

    cpu = build_simulator("smollm2-135m", "cpu-smollm2-135m")[3].scheduler
    gpu = build_simulator("smollm2-135m", "h100-smollm2-135m")[3].scheduler
    given = build_simulator("smollm2-135m", "cpu", {"max_step_ms": 0.0})[3].scheduler
    assert cpu.max_step_ms >= CPU_MAX_STEP_MS and gpu.max_step_ms == 0.0
    assert given.max_step_ms == 0.0


def test_a_learned_models_coefficients_predict_as_it_does():
    """`coefficients()` are seconds per unit of each term: a `LinearStepTime` of them (what
    the simulator times steps by, from a server's profile) predicts what the fit does."""
    learned = LearnedStepTime(prior=_profile())
    fixed = LinearStepTime(learned.coefficients())
    for shape in (StepShape().add(300, 0), StepShape().add(1, 500, count=32).add(64, 128)):
        assert fixed.shape_time(shape) == pytest.approx(learned.shape_time(shape))
    assert fixed.shape_time(StepShape()) == 0.0
    with pytest.raises(ValueError, match="8 coefficients"):
        LinearStepTime([1.0, 2.0])
    # a model of the first five or seven terms (a profile from before the adapter terms,
    # or before the prompt step's) prices the terms it lacks at nothing
    five = LinearStepTime(learned.coefficients()[:5])
    lora = StepShape().add(1, 500, count=8, adapter=True)
    lora.adapters = 2
    assert five.shape_time(lora) == pytest.approx(learned.shape_time(lora))
    seven = LinearStepTime(learned.coefficients()[:7] + [0.5])
    prompt = StepShape().add(300, 0)
    assert seven.shape_time(prompt) - LinearStepTime(learned.coefficients()[:7]).shape_time(
        prompt) == pytest.approx(0.5)


def test_a_prompts_step_cost_is_learned_apart_from_its_tokens():
    """A machine whose steps with a prompt pay 60 ms once (dequantized weights, another
    kernel path) beside their tokens: the profile's fit prices a 32-token prompt, which it
    did not time, within 10%, and decodes stay as cheap as they are."""
    def truth(shape: StepShape) -> float:
        return _truth(shape) + 0.060 * (shape.tokens > shape.seqs)

    model = LearnedStepTime(prior=[(s, truth(s)) for s, _ in _profile()])
    for shape in (StepShape().add(32, 0), StepShape().add(1, 256, count=8),
                  StepShape().add(48, 0).add(1, 256, count=4)):
        assert model.shape_time(shape) == pytest.approx(truth(shape), rel=0.1)
    assert dict(zip(STEP_TIME_TERMS, model.coefficients()))["prompt_step"] == pytest.approx(
        0.060, rel=0.1)


def test_one_prompt_size_is_priced_by_its_tokens_until_a_second_splits_its_step():
    """Serving starts with one prompt chunk timed: one size cannot tell a prompt's step from
    its tokens, so its tokens carry its cost (a prompt twice as long costs about twice as
    much, and the step sizer never takes prompt tokens for free)."""
    def truth(shape: StepShape) -> float:
        return _truth(shape) + 0.060 * (shape.tokens > shape.seqs)

    decodes = [StepShape().add(1, 100), StepShape().add(1, 100, count=4)]
    one = LearnedStepTime(prior=[(s, truth(s)) for s in decodes + [StepShape().add(128, 0)]])
    short, long = one.shape_time(StepShape().add(128, 0)), one.shape_time(StepShape().add(256, 0))
    assert long > 1.7 * short and one.prices_prompts
    assert dict(zip(STEP_TIME_TERMS, one.coefficients()))["prompt_step"] == 0


# ---------------------------------------------------------------- LoRA in the same budget

ADAPTER, ADAPTER_TOKEN = 0.004, 0.0005  # reading an adapter's weights; a row through one


def _lora_truth(shape: StepShape) -> float:
    return _truth(shape) + ADAPTER * shape.adapters + ADAPTER_TOKEN * shape.adapter_tokens


def test_adapter_steps_teach_the_model_what_an_adapter_costs():
    """Served steps that mix base rows with rows of one to four adapters: the fit learns the
    two adapter terms, and prices an adapter step the profile never timed within 5%."""
    model = LearnedStepTime(prior=_profile())
    base = StepShape().add(1, 300, count=8)
    for i in range(300):
        shape = StepShape().add(1, 300, count=4 + i % 8)
        lora = i % 3
        if lora:  # 1-4 adapters over 2-8 rows
            shape.add(1, 300, count=2 + i % 7, adapter=True)
            shape.adapters = 1 + i % 4
        model.observe(shape, _lora_truth(shape))
    probe = StepShape().add(1, 300, count=4).add(1, 300, count=12, adapter=True)
    probe.adapters = 3
    assert model.shape_time(probe) == pytest.approx(_lora_truth(probe), rel=0.05)
    assert model.shape_time(base) == pytest.approx(_truth(base), rel=0.05)
    coef = dict(zip(STEP_TIME_TERMS, model.coefficients()))
    assert coef["adapter"] == pytest.approx(ADAPTER, rel=0.2)
    assert coef["adapter_token"] == pytest.approx(ADAPTER_TOKEN, rel=0.2)


def test_the_step_shape_counts_the_adapters_its_requests_use():
    s = make_scheduler(num_blocks=400, block_size=16, max_loras=2)
    add(s, "a", 40, lora="x")
    add(s, "b", 24, lora="y")
    add(s, "c", 8)
    add(s, "d", 16, lora="x")
    out = s.schedule()
    shape = StepShape.of(out, s.requests)
    assert (shape.adapters, shape.adapter_tokens, shape.tokens) == (2, 80, 88)
    assert StepShape.of(out).adapters == 0  # no requests given: none counted


def test_decodes_through_adapters_leave_a_prompt_fewer_tokens():
    """Ten decodes: 10 ms + 10 ms of rows leave 80 ms for a prompt; through two adapters
    (+4 ms each, +0.5 ms a row) they leave 67 ms, so one block fewer joins them."""
    model = LinearStepTime([0.010, 0.001, 0.0, 0.0, 0.0, ADAPTER, ADAPTER_TOKEN])
    counts = {}
    for loras in ([None] * 10, ["x", "y"] * 5):
        s = make_scheduler(num_blocks=4000, block_size=16, step_time=model, max_step_ms=100.0,
                           max_loras=2)
        for i, lora in enumerate(loras):
            add(s, f"d{i}", 16, max_tokens=50, lora=lora)
        while any(not r.output_token_ids for r in s.requests.values()):
            step(s)
        add(s, "long", 1000)
        out, _ = step(s)
        assert model.shape_time(StepShape.of(out, s.requests)) <= 0.100
        counts[loras[0]] = prompt_tokens(out)
    assert counts == {None: 80, "x": 64}


def test_a_profile_with_a_learned_model_times_steps_by_it():
    from tidal.sim.cost_model import CostModel
    from tidal.sim.profiles import hardware, model_arch

    hw = hardware("cpu")
    hw.step_time, hw.step_overhead = [0.008, 0.0012, 0.002, 0.0, 0.0], 0.001
    cost = CostModel(model_arch("smollm2-135m"), hw)
    chunk = StepShape().add(1, 300, count=10).add(300, 0)
    assert cost.shape_time(chunk) == pytest.approx(0.008 + 0.0012 * 310 + 0.002 * 11 + 0.001)


def test_a_profile_with_the_servers_scatter_draws_step_times_from_it():
    """Measured / predicted of 0.8-2.0 at the quantiles: simulated steps scatter so (their
    runner part; the overhead is paid as is), while the scheduler's prediction stays put."""
    import random
    import statistics

    from tidal.core import ERROR_QUANTILES
    from tidal.sim.cost_model import CostModel
    from tidal.sim.profiles import hardware, model_arch

    hw = hardware("cpu")
    hw.step_time, hw.step_overhead = [0.010, 0.001, 0.0, 0.0, 0.0], 0.002
    hw.step_scatter = [0.8, 0.9, 0.95, 1.0, 1.1, 1.3, 2.0]
    cost = CostModel(model_arch("smollm2-135m"), hw)
    shape = StepShape().add(90, 0)  # 100 ms predicted by the model, 102 ms with overhead
    rng = random.Random(0)
    took = sorted((cost.step_seconds(shape, rng.random) - 0.002) / 0.100
                  for _ in range(20000))
    for q, want in zip(ERROR_QUANTILES, hw.step_scatter):
        assert took[int(q * len(took))] == pytest.approx(want, abs=0.02)
    assert cost.shape_time(shape) == pytest.approx(0.102)
    assert statistics.mean(took) > 1.05  # the slow tail lengthens the mean
    hw.step_scatter = [1.0, 2.0]
    with pytest.raises(ValueError, match="step_scatter holds 7 values"):
        CostModel(model_arch("smollm2-135m"), hw)


def test_background_prompts_alone_take_a_share_of_the_step_target():
    """A quarter of 100 ms at 10 ms + 1 ms a token holds 15 tokens: chunks of a block while
    only background prompts compute. Once a live prompt waits, the background prompt's
    partial prefill gives way and the live prompt's steps, which hold no background work,
    take the full 80; then the retracted prompt resumes from its cached block."""
    s = sized("fcfs", background_step_share=0.25)
    add(s, "batch", 200, background=True)
    assert scheduled(step(s)[0]) == {"batch": (16, 0)}
    add(s, "live", 200)
    add(s, "batch2", 20, background=True)  # would fit beside the live prompt: stays out
    ran = [step(s)[0] for _ in range(6)]
    assert ran[0].preempted_ids == ["batch"]
    assert [scheduled(out) for out in ran] == [
        {"live": (80, 0)}, {"live": (80, 80)}, {"live": (40, 160)},
        {"live": (1, 200), "batch2": (16, 0)}, {"live": (1, 201), "batch2": (4, 16)},
        {"live": (1, 202), "batch2": (1, 20), "batch": (16, 16)}]
