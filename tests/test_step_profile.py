"""The start-up step-time profile on a real (tiny) model runner: measured once within the
model's context and the pool, saved, read back by the next start; it seeds the engine's
step-time model and the step target; a different machine key measures anew."""

from __future__ import annotations

import json
import math

import pytest

from tidal.core import StepShape
from tidal.core.step_sizing import CPU_MAX_STEP_MS, EFFICIENT_CHUNK
from tidal.engine.config import EngineConfig
from tidal.engine.core import EngineCore
from tidal.engine import step_profile

from model_fixtures import small_folder


@pytest.fixture()
def folder(tmp_path, monkeypatch):
    monkeypatch.setenv("TIDAL_CACHE", str(tmp_path / "cache"))
    return small_folder(tmp_path, "tiny", "llama", max_position_embeddings=300)


def core(folder, **kwargs) -> EngineCore:
    config = EngineConfig.from_kwargs(model=str(folder), num_kv_blocks=kwargs.pop(
        "num_kv_blocks", 400), num_threads=1, **kwargs)
    return EngineCore(config, folder)


def finish_profile(c: EngineCore) -> int:
    """Time the rest of the profile as an idle server does; the shapes timed."""
    timed = 0
    while c.profile_idle():
        timed += 1
    return timed


def test_the_profile_is_measured_once_saved_and_read_back(folder, tmp_path, monkeypatch):
    measured = []
    real = step_profile.time_shape
    monkeypatch.setattr(step_profile, "time_shape",
                        lambda *a, **k: measured.append(1) or real(*a, **k))
    first = core(folder)
    saved = tmp_path / "cache" / "step-profiles"
    chunk = StepShape().add(1, 100, count=4).add(128, 0)
    # serving starts on the shapes timed first: one decode row and four; until a prompt is
    # priced a step holds one chunk of prompt at most
    assert len(first.profile.steps) == 2 and first.profiling() and not saved.exists()
    assert first.step_time.shape_time(chunk) > 0  # before any served step
    assert first.scheduler.target.prompt_cap == EFFICIENT_CHUNK
    assert first.profile_idle() and first.profile.steps[-1][0].tokens == EFFICIENT_CHUNK
    assert first.step_time.prices_prompts and first.scheduler.target.prompt_cap == math.inf
    assert finish_profile(first) >= 3 and not first.profiling() and not first.profile_idle()
    (saved,) = saved.glob("*.json")
    steps = json.loads(saved.read_text())["steps"]
    assert len(steps) >= 6 and len(steps) == len(first.profile.steps)
    # every shape fits the model's 300 positions: nothing after 1,024 cached tokens
    assert all(shape[5] <= 300 * shape[1] for shape, _ in steps)  # gathered <= 300 a seq
    predicted = first.step_time.shape_time(chunk)
    assert predicted > 0
    measured.clear()
    second = core(folder)
    assert not measured and not second.profiling()  # read back, not measured again
    assert second.step_time.shape_time(chunk) == pytest.approx(predicted)
    assert first.step_target_ms() == CPU_MAX_STEP_MS  # a tiny model is fast
    assert first.step_errors.ratios == type(first.step_errors.ratios)()


def test_idle_timing_waits_for_requests_and_keeps_the_prefix_cache(folder):
    """The rest of the profile is timed on blocks lent by the pool while no request is in
    the engine: a cached prefix is still hit afterwards, and its request answers as before."""
    from tidal.core import SamplingParams
    from tidal.core.invariants import check_invariants

    c = core(folder)
    prompt = list(range(3, 60))

    def answer(rid: str) -> list[int]:
        c.add(rid, prompt, SamplingParams(max_tokens=6, temperature=0.0))
        tokens = []
        while c.has_work():
            assert not c.profile_idle()  # a request is in: nothing is timed
            tokens += [t for o in c.step() for t in o.new_token_ids]
        return tokens

    first = answer("a")
    assert finish_profile(c) >= 3
    check_invariants(c.scheduler)
    pool = c.scheduler.kv.pool
    assert pool.num_free == pool.num_blocks and pool.num_cached >= 3
    hits = c.scheduler.prefix_hit_tokens
    assert answer("b") == first and c.scheduler.prefix_hit_tokens - hits >= 48


def test_a_context_too_short_for_the_timed_decodes_profiles_its_prompts(folder):
    """No decode row of the grid fits 200 positions: no yardstick either, and the idle
    timing still runs to its end."""
    c = core(folder, max_model_len=200)
    assert c.profile.reference is None and c.profiling()
    assert finish_profile(c) >= 1 and not c.profiling()
    assert all(s.seqs == 1 or s.tokens > s.seqs for s, _ in c.profile.steps)


def test_another_machine_key_measures_anew_and_none_when_asked(folder, tmp_path):
    finish_profile(core(folder))
    finish_profile(core(folder, num_kv_blocks=40))  # a pool too small for some shapes
    assert len(list((tmp_path / "cache" / "step-profiles").glob("*.json"))) == 2
    off = core(folder, step_profile_seconds=0)
    assert off.step_time.shape_time(StepShape().add(64, 0)) == 0.0  # learns from steps
    assert off.step_target_ms() == CPU_MAX_STEP_MS


def test_no_model_is_kept_where_nothing_sizes_steps(folder):
    """`--max-step-ms 0` under fcfs: no step-time model, no profile, no prediction log."""
    c = core(folder, max_step_ms=0.0)
    assert c.step_time is None and c.step_time_error() == []


def test_served_steps_are_logged_against_their_predictions(folder):
    c = core(folder)
    from tidal.core import ERROR_QUANTILES, SamplingParams

    c.add("a", list(range(3, 60)), SamplingParams(max_tokens=4, temperature=0.0))
    while c.has_work():
        c.step()
    errors = c.step_time_error()  # one ratio per quantile, ascending
    assert len(c.step_errors.ratios) == 4 and len(errors) == len(ERROR_QUANTILES)
    assert 0 < errors[0] and errors == sorted(errors)
    assert all(s.predicted > 0 for s in c.history.steps)


def test_offline_steps_are_not_sized_by_time_unless_asked(folder):
    """`LLM` computes a batch: no stream waits for a token there, so no step target (and
    no profile to time) unless one is given."""
    from tidal import LLM

    assert LLM(str(folder), num_kv_blocks=64).engine.core.config.scheduler.max_step_ms == 0
    given = LLM(str(folder), num_kv_blocks=64, max_step_ms=250.0)
    assert given.engine.core.config.scheduler.max_step_ms == 250.0


def test_shapes_timed_while_the_machine_is_busy_are_priced_at_its_speed_before(
        folder, monkeypatch):
    """Idle timing runs beside whatever else the machine does: each shape is scaled by a
    decode row timed before serving over the same row timed beside it, so a machine twice
    as slow meanwhile saves the prices it would have timed idle."""
    slowdown = [1.0]

    def fake(executor, entries, blocks, *args, **kwargs):
        if step_profile.shape_blocks(entries, executor.info.block_size) > len(blocks):
            return None
        shape = StepShape([(e[0], e[1], True) for e in entries])
        return shape, slowdown[0] * 1e-3 * step_profile.shape_tokens(entries)

    monkeypatch.setattr(step_profile, "time_shape", fake)
    c = core(folder)
    first = list(c.profile.steps)
    slowdown[0] = 2.0  # a client's own work, say, beside the idle engine
    finish_profile(c)
    later = c.profile.steps[len(first):]
    assert later and all(t == pytest.approx(1e-3 * s.tokens) for s, t in later)
    assert c.profile.steps[:len(first)] == first
