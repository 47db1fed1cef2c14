"""Speculative decoding end to end: with each proposer, greedy tokens equal those without
speculation (batched, chunked, prefix-cache hits, retraction, async steps, n > 1, stops),
seeded sampling gives the same tokens with and without it, and the acceptance rule keeps
the target's distribution (a chi-square test)."""

from __future__ import annotations

import pytest
import torch

from model_fixtures import PROMPTS, small_folder, tiny_folder
from tidal import LLM, SamplingParams
from tidal.model.sampler import SampleRow, sample
from tidal.spec import GuessTree, NgramProposer, SuffixProposer

PASSAGE = ("The scheduler plans a step and the runner executes it. The runner returns the "
           "sampled tokens and the scheduler applies them. Blocks that hold no token return "
           "to the pool.")
COPY = [f"Repeat this text exactly.\nText: {PASSAGE}\nRepeat: {PASSAGE[:40]}",
        "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\ndef mul(a, b):",
        "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,"]
MAX_TOKENS = 40
METHODS = ["ngram", "suffix"]


def engine(**kw) -> LLM:
    return LLM("smollm2-135m", dtype="float32", num_kv_blocks=kw.pop("num_kv_blocks", 256),
               **kw)


def greedy(llm: LLM, prompts: list[str], max_tokens: int = MAX_TOKENS, **params):
    p = SamplingParams(max_tokens=max_tokens, temperature=0, **params)
    return [[c.token_ids for c in o.outputs] for o in llm.generate(prompts, p, use_tqdm=False)]


def accepted(llm: LLM) -> int:
    return llm.engine.core.scheduler.spec.accepted_tokens


@pytest.fixture(scope="module")
def reference():
    llm = engine()
    prompts = COPY + PROMPTS[:4]
    return prompts, greedy(llm, prompts)


@pytest.mark.parametrize("method", METHODS)
def test_greedy_tokens_equal_those_without_speculation(reference, method):
    prompts, ref = reference
    llm = engine(speculative_method=method, num_speculative_tokens=5)
    assert [greedy(llm, [p])[0] for p in prompts] == ref  # one at a time
    assert greedy(llm, prompts) == ref  # batched
    assert greedy(llm, prompts) == ref  # again: prefix-cache hits, suffix cache warm
    stats = llm.engine.core.scheduler
    assert stats.spec.accepted_tokens > 100  # the copies were guessed
    assert stats.spec.accepted_tokens <= stats.spec.drafted_tokens
    assert llm.engine.core.scheduler.kv.num_free == llm.engine.core.scheduler.kv.num_blocks


@pytest.mark.parametrize("method", METHODS)
def test_the_served_gguf_weights_give_the_same_tokens_with_guesses(method):
    """In the GGUF file's own format, one request at a time: its 1 + k verification rows go
    through the integer kernels, which sum a row as they do alone (a near tie would
    otherwise flip a greedy token). Batches are not compared: past `MAX_ROWS` rows (16-48 by
    CPU) the Q8_0 LM head takes dequantized tiles, whose GEMM rounds otherwise, with or
    without guesses."""
    prompts = COPY + PROMPTS[:3]
    llm = LLM("smollm2-135m", num_kv_blocks=256, enable_prefix_caching=False)
    ref = [greedy(llm, [p], max_tokens=64)[0] for p in prompts]
    llm = LLM("smollm2-135m", num_kv_blocks=256, enable_prefix_caching=False,
              speculative_method=method, num_speculative_tokens=8, speculative_adaptive=False)
    assert [greedy(llm, [p], max_tokens=64)[0] for p in prompts] == ref
    assert accepted(llm) > 100


def test_chunked_prefill_retraction_and_async_steps_keep_the_tokens(reference):
    prompts, ref = reference
    # a pool this small with no decode reservation retracts requests mid-run
    llm = engine(speculative_method="ngram", num_kv_blocks=14, block_size=16,
                 chunked_prefill_size=16, max_input_tokens_per_step=48,
                 init_new_token_ratio=0.0, async_scheduling=True)
    assert greedy(llm, prompts) == ref
    s = llm.engine.core.scheduler
    assert s.num_preemptions > 0 and s.spec.accepted_tokens > 0


def test_max_tokens_and_stop_strings_cut_inside_an_accepted_run(reference):
    prompts, ref = reference
    llm = engine(speculative_method="ngram", num_speculative_tokens=8)
    short = greedy(llm, prompts[:1], max_tokens=7)
    assert short[0][0] == ref[0][0][:7]
    p = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, stop=["runner"])
    plain = engine().generate(prompts[:1], p, use_tqdm=False)[0].outputs[0]
    got = llm.generate(prompts[:1], p, use_tqdm=False)[0].outputs[0]
    assert got.finish_reason == plain.finish_reason == "stop"
    assert got.text == plain.text and "runner" not in got.text


def test_seeded_sampling_gives_the_same_tokens_with_and_without_speculation_in_any_batch():
    p = SamplingParams(max_tokens=30, temperature=0.8, seed=7, n=2, logprobs=2)
    plain = engine().generate(COPY[:2], p, use_tqdm=False)
    llm = engine(speculative_method="suffix")
    spec = llm.generate(COPY[:2], p, use_tqdm=False)
    alone = llm.generate(COPY[1:2], p, use_tqdm=False)  # another batch, other guesses
    assert [c.token_ids for c in alone[0].outputs] == [c.token_ids for c in plain[1].outputs]
    for a, b in zip(plain, spec):
        assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
        for ca, cb in zip(a.outputs, b.outputs):  # one logprob entry per token, same values
            assert len(cb.logprobs) == len(cb.token_ids)
            for la, lb in zip(ca.logprobs, cb.logprobs):
                assert la.logprob == pytest.approx(lb.logprob, abs=1e-3)
                assert [t for t, _ in la.top] == [t for t, _ in lb.top]
    assert accepted(llm) > 0


def test_penalties_and_min_tokens_see_the_guesses_before_each_row():
    p = SamplingParams(max_tokens=30, temperature=0, frequency_penalty=0.3,
                       repetition_penalty=1.1, min_tokens=12, ignore_eos=False)
    plain = engine().generate(COPY, p, use_tqdm=False)
    llm = engine(speculative_method="ngram")
    spec = llm.generate(COPY, p, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in plain]
    assert accepted(llm) > 0


def test_structured_outputs_guess_within_their_grammar_and_keep_their_tokens():
    """Guesses the grammar forbids are cut, rows are masked by the state after the guesses
    before them, and the matcher follows the accepted run: the same text as without."""
    prompts = ["Say ab ab ab ab:", f"List the words of: {PASSAGE[:60]}"]
    params = [SamplingParams(max_tokens=24, temperature=0, structured=("regex", "(ab ){3,12}")),
              SamplingParams(max_tokens=40, temperature=0, structured=(
                  "json", '{"type": "object", "properties": {"words": {"type": "array", '
                  '"items": {"type": "string"}}}, "required": ["words"]}'))]
    plain = [o.outputs[0].text for o in engine().generate(prompts, params, use_tqdm=False)]
    llm = engine(speculative_method="ngram")
    got = [o.outputs[0].text for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == plain and got[0].startswith("ab ab ab")
    assert accepted(llm) > 0


def test_a_draft_model_keeps_its_kv_through_every_path(reference):
    """The target as its own draft: its greedy guesses all pass exactly when the draft's KV
    follows every position the target computes: prompt chunks, recomputes after retraction,
    prefix-cache hits and the guessed positions of earlier verifications. Every step guesses
    its cap (not adaptive: how much guessing pays depends on the machine's step times)."""
    prompts, ref = reference
    llm = engine(speculative_method="draft", speculative_model="smollm2-135m",
                 num_kv_blocks=14, block_size=16, chunked_prefill_size=16,
                 max_input_tokens_per_step=48, init_new_token_ratio=0.0,
                 speculative_adaptive=False)
    assert greedy(llm, prompts) == ref
    assert greedy(llm, prompts[:3]) == ref[:3]  # prefix-cache hits
    s = llm.engine.core.scheduler
    assert s.num_preemptions > 0
    assert s.spec.drafted_tokens > 200
    assert s.spec.accepted_tokens >= 0.95 * s.spec.drafted_tokens


def test_a_poor_draft_model_still_gives_the_targets_tokens(reference, tmp_path):
    prompts, ref = reference
    draft = tiny_folder(tmp_path, "llama")  # random weights, the embedded tokenizer
    llm = engine(speculative_method="draft", speculative_model=str(draft))
    assert greedy(llm, prompts) == ref
    s = llm.engine.core.scheduler
    assert s.spec.accepted_tokens < 0.5 * s.spec.drafted_tokens


def test_a_draft_model_with_another_tokenizer_is_refused(tmp_path):
    other = small_folder(tmp_path, "words", "llama")  # a 256-word vocabulary
    with pytest.raises(ValueError, match="another tokenizer or vocabulary"):
        engine(speculative_method="draft", speculative_model=str(other))
    with pytest.raises(ValueError, match="needs one"):
        engine(speculative_method="draft")
    with pytest.raises(ValueError, match="P/D pair speculates"):
        engine(speculative_method="draft", speculative_model="smollm2-135m", role="decode")


def test_bad_speculation_options_fail_at_start():
    with pytest.raises(ValueError, match="num_speculative_tokens must be in"):
        engine(speculative_method="ngram", num_speculative_tokens=99)
    with pytest.raises(ValueError, match="needs a speculative_method"):
        engine(num_speculative_tokens=3)
    with pytest.raises(ValueError, match="speculative_method must be one of"):
        engine(speculative_method="medusa")
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        engine(speculative_method="ngram", prompt_lookup_min=5, prompt_lookup_max=2)


def test_the_acceptance_rule_keeps_the_target_distribution():
    """Row 0 samples the first token from p0; the guess g is kept iff that sample equals
    it, and then row 1 (computed after g) samples the next from p1. So the first emitted
    token follows p0, and after an accepted g the second follows p1: chi-square tests."""
    torch.manual_seed(0)
    p0 = torch.tensor([0.05, 0.4, 0.25, 0.2, 0.1])
    p1 = torch.tensor([0.3, 0.1, 0.1, 0.2, 0.3])
    g, trials = 1, 6000
    logits = torch.stack([p0.log(), p1.log()] * trials)
    params = SamplingParams(temperature=1.0)
    gen = torch.Generator().manual_seed(1)
    rows = [SampleRow(params, 1, [0], [], None) for _ in range(2 * trials)]
    tokens, _ = sample(logits, rows, gen)
    firsts, seconds = torch.zeros(5), torch.zeros(5)
    for t in range(trials):
        run = GuessTree.chain([g]).accept([tokens[2 * t][0], tokens[2 * t + 1][0]])[0]
        firsts[run[0]] += 1
        if run[0] == g:
            assert len(run) == 2
            seconds[run[1]] += 1
        else:
            assert len(run) == 1
    for counts, p in ((firsts, p0), (seconds, p1)):
        expected = p * counts.sum()
        chi2 = float(((counts - expected) ** 2 / expected).sum())
        assert chi2 < 18.47  # 4 degrees of freedom, p = 0.001


def accepted_run(guesses: list[int], samples: list[int]) -> list[int]:
    return GuessTree.chain(guesses).accept(samples)[0]


def test_accepted_run_greedy_cases():
    assert accepted_run([5, 6, 7], [5, 6, 7, 8]) == [5, 6, 7, 8]  # all kept, a bonus token
    assert accepted_run([5, 6, 7], [5, 9, 7, 8]) == [5, 9]  # the first mismatch is the last
    assert accepted_run([5], [4, 5]) == [4]
    assert accepted_run([], [3]) == [3]


def test_ngram_proposes_what_followed_the_latest_match():
    ngram = NgramProposer(1, 3)
    prompt = [1, 2, 3, 4, 9, 1, 2, 3, 5, 6]
    assert ngram.propose("a", prompt, [], 3).tokens == []  # ...5, 6: "6" never seen before
    # "6 1 2" -> "1 2" latest: 3 5 6
    assert ngram.propose("a", prompt, [1, 2], 3) == GuessTree.chain([3, 5, 6])
    # the longest n-gram "1 2 3"
    assert ngram.propose("a", prompt, [1, 2, 3], 2) == GuessTree.chain([5, 6])
    # follows the occurrence before the end
    assert ngram.propose("b", [7, 7, 7], [], 4) == GuessTree.chain([7])
    ngram.forget("a", [], False)
    assert "a" not in ngram._seqs


def test_suffix_guesses_by_frequency_and_learns_from_finished_outputs():
    suffix = SuffixProposer(max_depth=4, min_prob=0.3, cache_requests=2)
    assert suffix.propose("a", [1, 2, 3], [], 4).tokens == []
    # once "a" finished with output 3 4 5 6, a request ending in 3 guesses what followed,
    # at most spec_factor (2) times the length of its match
    suffix.propose("a", [1, 2, 3], [4, 5, 6], 4)
    suffix.forget("a", [3, 4, 5, 6], finished=True)
    assert suffix.propose("b", [9, 3], [], 3) == GuessTree.chain([4, 5])
    assert suffix.propose("g", [3, 4], [], 3) == GuessTree.chain([5, 6])
    # its own tokens: the continuation seen most often wins, and weak ones stop the guess
    assert suffix.propose("c", [8, 1, 8, 1, 8, 2, 8], [], 4).tokens[:1] == [1]
    # the shared cache keeps the last two outputs only
    suffix.forget("d", [20, 21], True)
    suffix.forget("e", [30, 31], True)
    assert suffix.propose("f", [3], [], 2).tokens == []


def test_a_prediction_is_guessed_first_and_changes_no_token(reference):
    """OpenAI's predicted outputs: with the answer itself as the prediction nearly every
    guess is accepted, and most of the answer is guessed (a step of k guesses also samples
    one token: at most k / (k + 1) of it); with a wrong one the answer is the same."""
    prompts, ref = reference
    i = len(COPY)  # a question: ngram lookup alone guesses little of its answer
    want = ref[i][0]
    llm = engine(speculative_method="ngram", num_speculative_tokens=5)
    spec = llm.engine.core.scheduler.spec
    assert greedy(llm, [prompts[i]]) == [[want]]
    plain, drafted = accepted(llm), spec.drafted_tokens
    assert greedy(llm, [prompts[i]], prediction=want) == [[want]]
    gained = accepted(llm) - plain
    assert gained >= 0.95 * (spec.drafted_tokens - drafted)
    assert gained >= 0.5 * len(want) > plain
    wrong = list(reversed(want)) + [5] * 10
    assert greedy(llm, [prompts[i]], prediction=wrong) == [[want]]


def test_prediction_lookup_walks_the_prediction_forward():
    from tidal.spec.prediction import PredictionLookup

    look = PredictionLookup()
    pred = [1, 2, 3, 4, 2, 3, 9, 10]
    assert look.propose("a", pred, [], 3).tokens == [1, 2, 3]
    assert look.propose("a", pred, [7, 2, 3], 2).tokens == [4, 2]  # the first match
    assert look.propose("a", pred, [7, 2, 3, 4, 2, 3], 3).tokens == [9, 10]  # then onward
    assert look.propose("a", pred, [7, 2, 3, 4, 2, 3, 9, 10], 3).tokens == []  # its end
    assert look.propose("a", pred, [7, 2, 3, 4, 2, 3, 9, 10, 1], 3).tokens == []  # not back
    look.forget("a")
    assert look.propose("a", pred, [8, 2], 3).tokens == []  # one token matches too much
    assert look.propose("a", pred, [8, 1, 2], 3).tokens == [3, 4, 2]
