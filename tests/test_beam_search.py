"""Beam search's bookkeeping (tidal/engine/beam_search.py) against an exhaustive search and
against a search that never stops early, over toy models; and `LLM.beam_search` against
the same reference run through `LLM.generate` on a tiny random model."""

from __future__ import annotations

import itertools
import math
import random

import pytest
from hypothesis import given, settings, strategies as st

from tidal import BeamSearchParams
from tidal.engine.beam_search import Beam, BeamSearch

STOP = 0  # the toy models' stop token


def toy_model(seed: int, vocab: int):
    """prefix -> logprobs of every next token, fixed by the seed (a dict stands in for
    the model's distribution)."""
    def logprobs(prefix: tuple[int, ...]) -> list[tuple[int, float]]:
        rng = random.Random(hash((seed, prefix)))
        weights = [rng.random() ** 3 + 1e-3 for _ in range(vocab)]
        total = sum(weights)
        return sorted(((t, math.log(w / total)) for t, w in enumerate(weights)),
                      key=lambda e: -e[1])
    return logprobs


def run(search: BeamSearch, model) -> list[Beam]:
    while search.live:
        search.extend([model(tuple(b.token_ids))[:search.num_candidates]
                       for b in search.live])
    return search.best()


def reference(model, width: int, max_tokens: int, penalty: float,
              stop: int = STOP) -> list[Beam]:
    """vLLM's beam search (scored by output length), to max_tokens with no early end:
    every stop-token candidate of every beam finishes, the `width` likeliest others go on."""
    live, done = [Beam()], []
    for _ in range(max_tokens):
        grown = []
        for beam in live:
            for token, lp in model(tuple(beam.token_ids))[:2 * width + 1]:
                child = Beam(beam.token_ids + [token], beam.cum_logprob + lp)
                (done if token == stop else grown).append(child)
        live = sorted(grown, key=lambda b: -b.cum_logprob)[:width]
    done += live
    return sorted(done, key=lambda b: -b.cum_logprob / len(b.token_ids) ** penalty)[:width]


def summary(beams: list[Beam]) -> list[tuple[list[int], float]]:
    return [(b.token_ids, round(b.cum_logprob, 9)) for b in beams]


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10**6), vocab=st.integers(2, 6), width=st.integers(1, 4),
       max_tokens=st.integers(1, 6), penalty=st.sampled_from([-1.0, 0.0, 0.5, 1.0, 2.0]))
def test_the_search_is_vllms_to_the_last_step(seed, vocab, width, max_tokens, penalty):
    """Stopping once no live beam can enter the answer never changes the answer."""
    model = toy_model(seed, vocab)
    got = run(BeamSearch(width, max_tokens, {STOP}, penalty), model)
    assert summary(got) == summary(reference(model, width, max_tokens, penalty))
    assert len(got) == width or vocab - 1 < width  # every step offers width beams to go on
    assert all(b.finish_reason in ("stop", "length") for b in got)
    assert all(b.finish_reason == "stop" or len(b.token_ids) == max_tokens for b in got)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10**6), vocab=st.integers(2, 4), max_tokens=st.integers(1, 4),
       penalty=st.sampled_from([0.0, 1.0, 2.0]))
def test_a_beam_as_wide_as_every_answer_finds_the_best_answers(seed, vocab, max_tokens,
                                                               penalty):
    """With nothing pruned, the answer is the best answers of an exhaustive search."""
    model = toy_model(seed, vocab)
    answers = []
    for length in range(1, max_tokens + 1):
        for tokens in itertools.product(range(vocab), repeat=length):
            if STOP in tokens[:-1] or (tokens[-1] != STOP and length < max_tokens):
                continue  # a stop token ends an answer; only max_tokens ends one without
            cum = sum(dict(model(tokens[:i]))[t] for i, t in enumerate(tokens))
            answers.append((cum / length ** penalty, list(tokens)))
    width = len(answers)
    got = run(BeamSearch(width, max_tokens, {STOP}, penalty), model)
    want = sorted(answers, key=lambda a: -a[0])
    assert [b.token_ids for b in got] == [tokens for _, tokens in want]


def test_masked_candidates_are_left_out_and_a_stop_token_keeps_its_place():
    search = BeamSearch(2, 3, {STOP}, 1.0)
    search.extend([[(5, -0.1), (STOP, -0.2), (7, -9999.0), (6, -3.0)]])
    assert [b.token_ids for b in search.live] == [[5], [6]]
    assert search.finished[0].token_ids == [STOP] and search.finished[0].text_ids(False) == []
    assert search.finished[0].text_ids(True) == [STOP]
    with pytest.raises(ValueError, match="2 beams"):
        search.extend([[(1, -1.0)]])


@pytest.mark.parametrize("kwargs", [dict(beam_width=0, max_tokens=4),
                                    dict(beam_width=2, max_tokens=0),
                                    dict(beam_width=2, max_tokens=4, length_penalty=math.nan)])
def test_beam_search_params_are_checked(kwargs):
    with pytest.raises(ValueError):
        BeamSearchParams(**kwargs)


def test_llm_beam_search_equals_the_reference_run_through_generate(tmp_path):
    """The offline API's beams: the reference search, stepping `LLM.generate` itself."""
    from model_fixtures import tiny_folder
    from tidal import LLM, SamplingParams

    # beams rank by log-probabilities whatever the engine's logprobs report
    llm = LLM(str(tiny_folder(tmp_path, "llama")), dtype="float32", num_kv_blocks=256,
              block_size=4, logprobs_mode="raw_logits")
    prompt = [5, 9, 13, 2, 7]
    width, max_tokens = 3, 5

    def model(prefix):
        out = llm.generate({"prompt_token_ids": prompt + list(prefix)},
                           SamplingParams(max_tokens=1, temperature=0, ignore_eos=True,
                                          logprobs=2 * width + 1,
                                          logprobs_mode="adjusted_logprobs"), use_tqdm=False)
        return out[0].outputs[0].logprobs[0].top

    want = reference(model, width, max_tokens, 1.0, stop=llm.tokenizer.eos_token_id)
    got = llm.beam_search({"prompt_token_ids": prompt},
                          BeamSearchParams(beam_width=width, max_tokens=max_tokens))[0]
    assert [s.token_ids for s in got.sequences] == [b.token_ids for b in want]
    for s, b in zip(got.sequences, want):
        assert s.cum_logprob == pytest.approx(b.cum_logprob, abs=1e-4)
        assert s.text == llm.tokenizer.decode(b.text_ids(False))
