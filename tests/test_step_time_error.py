"""The engine's step-time model, seeded by the start-up profile alone, against step times
measured on this machine with the embedded model over a mix of shapes the profile did not
time: prompt chunks of 32 to 4,096 tokens (some after a cached prefix), decodes of 1 to 64
rows at other contexts, a chunk beside decodes, and decodes verifying 2-4 guesses each
(ngram speculation: a guess is a decode row, and is priced as one). What is held: the
shapes' prices relative to one another, within a factor of SPREAD of their median ratio,
and the median itself within MEDIAN. A 2-core VM's speed moves by 30-40% within a minute,
between the profile's timing and the mix's: runs on a 2-core Xeon gave ratios of 0.87-1.62
(median 1.27), 0.65-1.35 (0.96) and 0.53-1.27 (0.69); served steps correct the scale
online (docs/design/step-time.md)."""

from __future__ import annotations

import statistics

import pytest

from tidal.core import LearnedStepTime
from tidal.engine.config import EngineConfig
from tidal.engine.worker import Worker
from tidal.engine.step_profile import REPEAT_SECONDS, StepProfile, measure

from model_fixtures import embedded_folder

# Each shape's predicted / measured within a factor of SPREAD either way of their median,
# and the median (the machine's speed at the profile's timing against at the mix's) within
# MEDIAN.
# 2.5, not 2: on a 2-core Zen 4 VM prompt steps ran at half speed for minutes at a time
# (decodes did not), so the mix's first prompts came out 0.46-0.49 of the median in both
# suite runs there, the profile having timed them at full speed.
SPREAD, MEDIAN = 2.5, (0.5, 2.0)
RETIMES = 3  # rounds of timing again the shapes outside the spread

MIX = ([[(n, 0)] for n in (32, 128, 384, 768)]
       + [[(512, 1024)], [(128, 2048)]]
       + [[(1, 100)] * b for b in (2, 8, 32)] + [[(1, 700)] * b for b in (1, 24, 64)]
       + [[(192, 0)] + [(1, 400)] * 8, [(64, 0)] * 6 + [(1, 200)] * 20]
       + [[(2048, 0)], [(4096, 0)]]
       + [[(1, 300, 4)], [(1, 300, 4)] * 8, [(1, 600, 2)] * 16,
          [(128, 0)] + [(1, 400, 3)] * 6])
GUESSES = 4


@pytest.fixture(scope="module")
def runner():
    config = EngineConfig.from_kwargs(model="smollm2-135m", num_kv_blocks=3000,
                                      speculative_method="ngram",
                                      num_speculative_tokens=GUESSES)
    return Worker(embedded_folder(), config.model, 16, config.scheduler,
                       config.speculative)


def test_the_profile_prices_a_mix_of_steps_it_did_not_time(runner, tmp_path, monkeypatch):
    # Timed here rather than read from the saved profile: one saved by an earlier test, under
    # other load, would price this minute's machine with another's speed.
    monkeypatch.setenv("TIDAL_CACHE", str(tmp_path))
    prior = StepProfile(runner, embedded_folder(), 10.0, 49152, 8192).measure_all()
    model = LearnedStepTime(prior=prior)
    measure(runner, MIX[:1], repeats=0, vocab=49152, warmups=1)
    timed = measure(runner, MIX, repeats=3, vocab=49152, warmups=0,
                    repeat_seconds=REPEAT_SECONDS)
    ratios = [model.shape_time(shape) / seconds for shape, seconds in timed]
    # A shape outside the spread is timed again, up to RETIMES times: a 32-token prompt's
    # step took 85 ms, or 185-200 ms, in one process with nothing else running; a shape
    # the model misprices stays out.
    for _ in range(RETIMES):
        median = statistics.median(ratios)
        for i, ratio in enumerate(ratios):
            if not 1 / SPREAD <= ratio / median <= SPREAD:
                timed[i] = measure(runner, [MIX[i]], repeats=3, vocab=49152, warmups=0,
                                   repeat_seconds=REPEAT_SECONDS)[0]
                ratios[i] = model.shape_time(timed[i][0]) / timed[i][1]
    for (shape, seconds), ratio in zip(timed, ratios):
        print(f"{shape.seqs:3d} seqs {shape.tokens:5d} tokens {shape.kv_tokens:6d} KV: "
              f"measured {seconds * 1e3:7.1f} ms, predicted / measured {ratio:.2f}")
    assert len(timed) == len(MIX)
    assert all(k == GUESSES for k in _verified(runner, [(1, 300, GUESSES)] * 2))
    median = statistics.median(ratios)
    assert MEDIAN[0] <= median <= MEDIAN[1], ratios
    assert all(1 / SPREAD <= r / median <= SPREAD for r in ratios), ratios


def _verified(runner, entries) -> list[int]:
    """The guesses the runner verified for each of `entries` (one run of their step)."""
    from tidal.core import NewRequest, SamplingParams, ScheduledRequest, SchedulerOutput

    phrase = list(range(100, 116))
    new, scheduled = [], []
    for i, (n, c, k) in enumerate(entries):
        rid = f"verify-{i}"
        new.append(NewRequest(rid, [phrase[j % 16] for j in range(n + c)], [],
                              SamplingParams(temperature=0.0), [], 1))
        blocks = -(-(n + c + k) // runner.block_size)
        table = list(range(i * blocks, (i + 1) * blocks))
        scheduled.append(ScheduledRequest(rid, n + k, c, table, True, False))
    result = runner.execute(SchedulerOutput(0, "mixed", scheduled, new))
    for s in scheduled:
        runner.forget(s.request_id)
    return [result.drafted.get(s.request_id, 0) for s in scheduled]
