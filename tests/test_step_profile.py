"""The start-up step-time profile on a real (tiny) model runner: measured once within the
model's context and the pool, saved, read back by the next start; it seeds the engine's
step-time model and the step target; a different machine key measures anew."""

from __future__ import annotations

import json

import pytest

from tidal.core import StepShape
from tidal.core.step_sizing import CPU_MAX_STEP_MS
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


def test_the_profile_is_measured_once_saved_and_read_back(folder, tmp_path, monkeypatch):
    measured = []
    real = step_profile.measure
    monkeypatch.setattr(step_profile, "measure",
                        lambda *a, **k: measured.append(1) or real(*a, **k))
    first = core(folder)
    (saved,) = (tmp_path / "cache" / "step-profiles").glob("*.json")
    steps = json.loads(saved.read_text())["steps"]
    assert measured and len(steps) >= 6
    # every shape fits the model's 300 positions: nothing after 1,024 cached tokens
    assert all(shape[5] <= 300 * shape[1] for shape, _ in steps)  # gathered <= 300 a seq
    chunk = StepShape().add(1, 100, count=4).add(128, 0)
    predicted = first.step_time.shape_time(chunk)
    assert predicted > 0  # before any served step
    measured.clear()
    second = core(folder)
    assert not measured  # read back, not measured again
    assert second.step_time.shape_time(chunk) == pytest.approx(predicted)
    assert first.config.scheduler.max_step_ms == CPU_MAX_STEP_MS  # a tiny model is fast
    assert first.step_errors.ratios == type(first.step_errors.ratios)()


def test_another_machine_key_measures_anew_and_none_when_asked(folder, tmp_path):
    core(folder)
    core(folder, num_kv_blocks=40)  # a pool too small for some shapes: its own profile
    assert len(list((tmp_path / "cache" / "step-profiles").glob("*.json"))) == 2
    off = core(folder, step_profile_seconds=0)
    assert off.step_time.shape_time(StepShape().add(64, 0)) == 0.0  # learns from steps
    assert off.config.scheduler.max_step_ms == CPU_MAX_STEP_MS


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
