"""Sampling on a tiny random model: seeds reproduce across batch compositions, filters and
penalties do what they say, logprobs match the distribution, stop strings cut the text."""

from __future__ import annotations

import math

import pytest
import torch

from model_fixtures import PROMPTS, tiny_folder
from tidal import LLM, SamplingParams
from tidal.engine.detokenizer import IncrementalDetokenizer
from tidal.model.sampler import SampleRow, sample


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    folder = tiny_folder(tmp_path_factory.mktemp("tiny"), "llama")
    return LLM(str(folder), dtype="float32", num_kv_blocks=128, block_size=4)


def ids(llm, prompts):
    return [{"prompt_token_ids": llm.engine.tokenize(p)} for p in prompts]


def test_seeded_sampling_is_reproducible_across_batches(llm):
    seeded = SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, seed=1234, ignore_eos=True)
    alone = llm.generate(ids(llm, PROMPTS[:1]), seeded, use_tqdm=False)[0].outputs[0].token_ids
    other = SamplingParams(max_tokens=7, temperature=0.8, ignore_eos=True)
    mixed = llm.generate(ids(llm, PROMPTS[1:4] + PROMPTS[:1] + PROMPTS[4:]),
                         [other] * 3 + [seeded] + [other] * 4, use_tqdm=False)
    assert mixed[3].outputs[0].token_ids == alone
    different = SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, seed=99, ignore_eos=True)
    assert llm.generate(ids(llm, PROMPTS[:1]), different,
                        use_tqdm=False)[0].outputs[0].token_ids != alone


def test_n_sequences_fork_and_share_the_prompt(llm):
    out = llm.generate(ids(llm, PROMPTS[:1]), SamplingParams(max_tokens=6, n=3, temperature=1.0,
                                                             seed=7, ignore_eos=True),
                       use_tqdm=False)[0]
    assert [len(o.token_ids) for o in out.outputs] == [6, 6, 6]
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1
    assert not llm.engine.scheduler.requests and llm.engine.scheduler.kv.pool.num_used == 0


def row(**kw):
    return SampleRow(SamplingParams(**kw), 1, [], [], None)


def test_top_k_and_min_p_and_top_p_restrict_the_support():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]] * 3))
    gen = torch.Generator().manual_seed(0)
    seen = [set(), set(), set()]
    for _ in range(300):
        toks, _ = sample(logits, [row(temperature=1, top_k=2), row(temperature=1, min_p=0.5),
                                  row(temperature=1, top_p=0.7)], gen)
        for s, t in zip(seen, toks):
            s.add(t[0])
    assert seen == [{0, 1}, {0, 1}, {0, 1}]


def test_allowed_token_ids_are_all_that_is_sampled():
    """Greedy takes the likeliest allowed token, sampling never leaves the allowed ones, and
    their logprobs are of the masked distribution (the allowed ones' mass is 1)."""
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]] * 2))
    gen = torch.Generator().manual_seed(0)
    seen = set()
    for _ in range(200):
        (greedy, drawn), lps = sample(logits, [
            row(temperature=0, allowed_token_ids=[3, 2], logprobs=1),
            row(temperature=1, allowed_token_ids=[1, 3])], gen)
        assert greedy == [2]
        seen.add(drawn[0])
    assert seen == {1, 3}
    assert math.isclose(math.exp(lps[0][0].logprob), 0.15 / 0.2, rel_tol=1e-5)
    with pytest.raises(ValueError, match="allowed_token_ids must name"):
        SamplingParams(allowed_token_ids=[])
    with pytest.raises(ValueError, match="cache_salt must be"):
        SamplingParams(cache_salt="")


def test_a_bad_words_last_token_is_banned_after_the_tokens_before_it():
    from tidal.model.sampler import bad_word_ends

    words = [[3], [1, 2], [0, 1, 2]]
    assert bad_word_ends(words, []) == [3]
    assert bad_word_ends(words, [5, 1]) == [3, 2]
    assert bad_word_ends(words, [0, 1]) == [3, 2, 2]
    assert bad_word_ends(words, [1, 0]) == [3]
    logits = torch.log(torch.tensor([[0.1, 0.1, 0.5, 0.3]]))
    banned = SampleRow(SamplingParams(temperature=0, bad_words_token_ids=words), 1, [], [4, 1],
                       None)
    assert sample(logits, [banned], torch.Generator())[0] == [[0]]  # 2 and 3 out


def test_penalties_and_logprobs():
    logits = torch.tensor([[2.0, 1.9, 0.0]])
    gen = torch.Generator().manual_seed(0)
    plain, lp = sample(logits, [row(temperature=0, logprobs=2)], gen)
    assert plain == [[0]]
    probs = logits.log_softmax(-1)[0]
    assert lp[0][0].logprob == pytest.approx(probs[0].item())
    assert [t for t, _ in lp[0][0].top] == [0, 1]
    penalised = SampleRow(SamplingParams(temperature=0, presence_penalty=0.5), 1, [], [0], None)
    assert sample(logits, [penalised], gen)[0] == [[1]]
    repeated = SampleRow(SamplingParams(temperature=0, repetition_penalty=1.2), 1, [0], [], None)
    assert sample(logits, [repeated], gen)[0] == [[1]]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_tiny_repetition_penalty_never_revives_a_masked_token(temperature):
    """A grammar mask leaves -inf; a repetition penalty of 5e-324 on a masked token seen in
    the prompt once clamped that -inf to a finite logit, which then beat the one token the
    grammar allowed (a 500 "token doesn't satisfy the grammar", found by the schema fuzzer)."""
    masked = float("-inf")
    logits = torch.tensor([[masked, masked, -30.0, masked]])  # the grammar allows token 2
    tiny = SampleRow(SamplingParams(temperature=temperature, repetition_penalty=5e-324),
                     1, [0, 1, 3], [], None)
    for seed in range(20):
        assert sample(logits, [tiny], torch.Generator().manual_seed(seed))[0] == [[2]]


def test_a_top_p_that_rounds_to_zero_keeps_the_likeliest_token():
    """top_p=5e-324 is 0 in float32: every token's mass before it reached it, and the row
    was all -inf (a 500 under a grammar, found by the schema fuzzer)."""
    logits = torch.tensor([[float("-inf"), 1.0, float("-inf"), 0.5]])
    tiny = SampleRow(SamplingParams(temperature=1.0, top_p=5e-324), 1, [], [], None)
    for seed in range(20):
        assert sample(logits, [tiny], torch.Generator().manual_seed(seed))[0] == [[1]]


class _CharTokenizer:
    """One character per token id (ord), multi-byte-free: enough to test stop handling."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(map(chr, ids))


def test_stop_string_cuts_text_and_holds_back_a_possible_start():
    d = IncrementalDetokenizer(_CharTokenizer(), ["END"])
    assert d.add([ord(c) for c in "abcE"]) == "ab"  # the last len("END") - 1 chars are held
    assert d.add([ord("N")]) == "c"
    assert d.add([ord("D"), ord("x")]) == "" and d.stopped
    assert d.text == "abc"
    e = IncrementalDetokenizer(_CharTokenizer(), ["END"])
    assert e.add([ord(c) for c in "xyzEN"]) == "xyz"
    assert e.flush() == "EN" and not e.stopped


def test_a_stop_string_is_kept_when_asked_for():
    d = IncrementalDetokenizer(_CharTokenizer(), ["END"], include_stop=True)
    assert d.add([ord(c) for c in "abENDx"]) == "abEND" and d.stopped
    assert d.stop_string == "END" and d.flush() == ""


def test_stop_string_finishes_the_request(llm):
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    full = llm.generate(ids(llm, PROMPTS[:1]), params, use_tqdm=False)[0].outputs[0]
    stop = full.text[3:6]
    assert stop
    cut = llm.generate(ids(llm, PROMPTS[:1]), SamplingParams(
        max_tokens=12, temperature=0, ignore_eos=True, stop=[stop]), use_tqdm=False)[0].outputs[0]
    assert cut.finish_reason == "stop" and cut.text == full.text[:full.text.index(stop)]
    assert not llm.engine.scheduler.requests


def test_an_output_counts_its_prompts_tokens_read_from_the_prefix_cache(llm):
    """GenerationOutput.num_cached_tokens (vLLM's): none on a fresh prompt; its whole blocks
    (4 tokens) but the one holding the last token on the same prompt again, also when a
    stop string ends it."""
    prompt = {"prompt_token_ids": [5 + i % 50 for i in range(23)]}
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    first, again = (llm.generate([prompt], params, use_tqdm=False)[0] for _ in range(2))
    assert (first.num_cached_tokens, again.num_cached_tokens) == (0, 20)
    stop = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True,
                          stop=[first.outputs[0].text[1:3]])
    cut = llm.generate([prompt], stop, use_tqdm=False)[0]
    assert cut.outputs[0].finish_reason == "stop" and cut.num_cached_tokens == 20


def test_a_stop_tokens_text_is_left_out_unless_asked_for(llm):
    """vLLM's: the token that ends a request by stop_token_ids counts as an output token,
    but its text is left out, as a stop string's is (include_stop_str_in_output keeps
    it)."""
    params = dict(max_tokens=12, temperature=0, ignore_eos=True)
    full = llm.generate(ids(llm, PROMPTS[:1]), SamplingParams(**params),
                        use_tqdm=False)[0].outputs[0]
    tokens = full.token_ids
    stop = next(t for t in tokens[2:] if llm.engine.tokenizer.decode([t]).strip())
    at = tokens.index(stop)
    text_before = llm.engine.tokenizer.decode(tokens[:at])
    for include in (False, True):
        out = llm.generate(ids(llm, PROMPTS[:1]), SamplingParams(
            **params, stop_token_ids=[stop], include_stop_str_in_output=include),
            use_tqdm=False)[0].outputs[0]
        assert out.finish_reason == "stop" and out.token_ids == tokens[:at + 1]
        want = llm.engine.tokenizer.decode(tokens[:at + 1]) if include else text_before
        assert out.text == want


def test_bad_words_keep_their_sequences_out_of_the_output(llm):
    """A one-token bad word never comes; a two-token one never completes (its first token
    may). Offline, bad_words as text are tokenized by the engine (Tokenizer.bad_word_ids)."""
    params = dict(max_tokens=12, temperature=0, ignore_eos=True)
    free = llm.generate(ids(llm, PROMPTS[:1]), SamplingParams(**params),
                        use_tqdm=False)[0].outputs[0].token_ids
    first, pair = free[0], free[3:5]
    out = llm.generate(ids(llm, PROMPTS[:1]), SamplingParams(
        **params, bad_words_token_ids=[[first], pair]), use_tqdm=False)[0].outputs[0].token_ids
    assert first not in out
    assert all(out[i:i + 2] != pair for i in range(len(out) - 1))
    word = llm.engine.tokenizer.decode([free[2]]).strip()
    if word:  # a word of the text: each of its spellings is out
        banned = llm.engine.tokenizer.bad_word_ids([word])
        text = llm.generate(ids(llm, PROMPTS[:1]), SamplingParams(**params, bad_words=[word]),
                            use_tqdm=False)[0].outputs[0].token_ids
        assert not any(text[i:i + len(w)] == w for w in banned for i in range(len(text)))


def test_bad_input_is_refused_and_nothing_leaks(llm):
    with pytest.raises(ValueError):
        llm.generate([{"prompt_token_ids": [10 ** 7]}], use_tqdm=False)
    with pytest.raises(ValueError):
        SamplingParams(temperature=-1)
    with pytest.raises(TypeError):
        llm.generate([3.5], use_tqdm=False)
    assert not llm.engine.scheduler.requests and llm.engine.scheduler.kv.pool.num_used == 0


def test_chat_uses_the_template(llm):
    out = llm.chat([{"role": "user", "content": "hi"}],
                   SamplingParams(max_tokens=3, temperature=0, ignore_eos=True), use_tqdm=False)
    text = llm.tokenizer.decode(out[0].prompt_token_ids, skip_special_tokens=False)
    assert text.startswith("<|im_start|>system") and text.endswith("<|im_start|>assistant\n")


def test_a_runner_error_fails_its_step_and_the_engine_goes_on(llm, monkeypatch):
    real, calls = llm.engine.runner.execute, []

    def flaky(out):
        calls.append(len(out.scheduled))
        if len(calls) == 2:
            raise RuntimeError("injected fault")
        return real(out)

    monkeypatch.setattr(llm.engine.runner, "execute", flaky)
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    outs = llm.generate(ids(llm, PROMPTS[:3]), params, use_tqdm=False)
    assert [o.outputs[0].finish_reason for o in outs] == ["error"] * 3
    assert all(len(o.outputs[0].token_ids) == 1 for o in outs)  # the first step's token only
    assert not llm.engine.scheduler.requests and llm.engine.scheduler.kv.pool.num_used == 0
    again = llm.generate(ids(llm, PROMPTS[:3]), params, use_tqdm=False)
    assert [o.outputs[0].finish_reason for o in again] == ["length"] * 3


def test_logit_bias_shifts_the_logits_before_sampling():
    logits = torch.tensor([[2.0, 1.9, 0.0]])
    gen = torch.Generator().manual_seed(0)
    assert sample(logits, [row(temperature=0, logit_bias={2: 2.5})], gen)[0] == [[2]]
    assert sample(logits, [row(temperature=0, logit_bias={0: -100})], gen)[0] == [[1]]
    _, lp = sample(logits, [row(temperature=0, logit_bias={1: 1.0}, logprobs=1)], gen)
    biased = torch.tensor([[2.0, 2.9, 0.0]]).log_softmax(-1)[0]
    assert lp[0][0].logprob == pytest.approx(biased[1].item())  # logprobs see the bias
    assert torch.equal(logits, torch.tensor([[2.0, 1.9, 0.0]]))  # the caller's are untouched
    seen = set()
    for _ in range(300):  # -100 all but bans a token at any temperature
        toks, _ = sample(logits, [row(temperature=2.0, logit_bias={0: -100, 1: -100})], gen)
        seen.add(toks[0][0])
    assert seen == {2}


def test_logprobs_modes_report_each_stage_of_the_distribution():
    """raw: the model's; adjusted (the default): after the bias; processed: after the
    temperature and top-k too, filtered tokens at the floor; *_logits: the values alone. A
    request's own mode beats the engine's, rows of several modes share a step, and a greedy
    row's processed distribution is its adjusted one."""
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0]])
    asked = dict(logit_bias={3: 3.0}, temperature=2.0, top_k=2, logprobs=4)
    adjusted = logits + torch.tensor([0.0, 0.0, 0.0, 3.0])
    processed = (adjusted / 2).masked_fill(torch.tensor([False, True, True, False]),
                                           float("-inf"))
    want = {"raw_logits": logits, "raw_logprobs": logits.log_softmax(-1),
            "adjusted_logits": adjusted, "adjusted_logprobs": adjusted.log_softmax(-1),
            "processed_logits": processed, "processed_logprobs": processed.log_softmax(-1)}

    def reported(entry) -> list[float]:
        return [v for _, v in sorted(entry.top)]

    gen = torch.Generator().manual_seed(0)
    for mode, values in want.items():
        expected = values.clamp(min=-9999.0)[0].tolist()
        tokens, lp = sample(logits, [row(**asked)], gen, logprobs_mode=mode)
        assert reported(lp[0][0]) == pytest.approx(expected, abs=1e-6)
        assert lp[0][0].logprob == pytest.approx(expected[tokens[0][0]], abs=1e-6)
        assert tokens[0][0] in (0, 3)  # the mode changes the report, not the draw
        _, own = sample(logits, [row(**asked, logprobs_mode=mode)], gen)
        assert reported(own[0][0]) == pytest.approx(expected, abs=1e-6)
    greedy = row(temperature=0, logit_bias={3: 3.0}, logprobs=4)
    mixed = [row(**asked, logprobs_mode=m) for m in want] + [greedy]
    _, lps = sample(logits.expand(len(mixed), -1), mixed, gen, logprobs_mode="processed_logits")
    for entry, values in zip(lps, [*want.values(), adjusted]):  # greedy: adjusted = processed
        assert reported(entry[0]) == pytest.approx(values.clamp(min=-9999.0)[0].tolist(),
                                                   abs=1e-6)
    with pytest.raises(ValueError, match="logprobs_mode must be one of"):
        SamplingParams(logprobs_mode="logits")


def test_logit_bias_through_the_engine(llm):
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    plain = llm.generate(ids(llm, PROMPTS[:2]), params, use_tqdm=False)
    first = plain[0].outputs[0].token_ids[0]
    banned = llm.generate(ids(llm, PROMPTS[:1]), SamplingParams(
        max_tokens=6, temperature=0, ignore_eos=True, logit_bias={first: -100}),
        use_tqdm=False)[0].outputs[0].token_ids
    assert first not in banned
    forced = SamplingParams(max_tokens=5, temperature=1.0, n=2, seed=3, ignore_eos=True,
                            logit_bias={1234: 100})
    out = llm.generate(ids(llm, PROMPTS[:1]), forced, use_tqdm=False)[0]
    assert [o.token_ids for o in out.outputs] == [[1234] * 5] * 2  # forked siblings too
    # A biased request leaves its batch neighbours as they were.
    mixed = llm.generate(ids(llm, PROMPTS[:2]), [SamplingParams(
        max_tokens=6, temperature=0, ignore_eos=True, logit_bias={first: -100}), params],
        use_tqdm=False)
    assert mixed[0].outputs[0].token_ids == banned
    assert mixed[1].outputs[0].token_ids == plain[1].outputs[0].token_ids


def test_logit_bias_is_validated(llm):
    for bad in ({5: 101}, {5: -100.5}, {-1: 1.0}, {"5": 1.0}, {5: "x"}, {True: 1.0}):
        with pytest.raises(ValueError):
            SamplingParams(logit_bias=bad)
    assert SamplingParams(logit_bias={5: 100, 6: -100}).logit_bias == {5: 100.0, 6: -100.0}
    with pytest.raises(ValueError, match="logit_bias"):  # the vocabulary has 49152 ids
        llm.generate(ids(llm, PROMPTS[:1]), SamplingParams(logit_bias={49152: 1.0}),
                     use_tqdm=False)
    assert not llm.engine.scheduler.requests and llm.engine.scheduler.kv.pool.num_used == 0


def test_every_tensor_the_sampler_makes_lands_on_the_logits_device():
    """With the default device set to `meta`, a tensor made without the logits' device would
    land there and break the first operation mixing it with the (CPU) logits: what a CPU
    tensor does beside CUDA logits. Every option that builds tensors runs at once; the
    tokens equal a run without the trap (same seeds)."""
    torch.manual_seed(0)
    logits = torch.randn(6, 50)

    def rows():
        seeded = [torch.Generator().manual_seed(7), torch.Generator().manual_seed(8)]
        return [
            SampleRow(SamplingParams(temperature=0.8, top_k=5, seed=7), 2, [1, 2], [3], seeded),
            SampleRow(SamplingParams(temperature=1.0, top_p=0.7), 1, [], [], None),
            SampleRow(SamplingParams(temperature=1.0, min_p=0.2, logprobs=3), 1, [], [], None),
            SampleRow(SamplingParams(temperature=0.5, presence_penalty=0.5, frequency_penalty=0.3,
                                     repetition_penalty=1.3), 1, [4, 5], [4, 6, 6], None),
            SampleRow(SamplingParams(temperature=1.0, logit_bias={9: 5.0}), 1, [], [], None, [2]),
            SampleRow(SamplingParams(temperature=0, logprobs=2), 1, [], [], None),
        ]

    expected = sample(logits, rows(), torch.Generator().manual_seed(1))
    with torch.device("meta"):
        got = sample(logits, rows(), torch.Generator().manual_seed(1))
    assert got == expected
    assert all(0 <= t < 50 for toks in got[0] for t in toks)


def test_a_step_comes_back_to_the_host_in_one_copy(monkeypatch):
    """Every option at once (n > 1, seeds, filters, penalties, bans, bias, logprobs of
    several widths, greedy rows): one device-to-host copy, the GPU step's one wait."""
    copies = []
    for name in ("tolist", "item", "cpu", "numpy", "__bool__", "__int__", "__float__"):
        real = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name,
                            lambda self, *a, _real=real, _name=name, **k:
                            copies.append(_name) or _real(self, *a, **k))
    torch.manual_seed(0)
    logits = torch.randn(5, 40)
    rows = [SampleRow(SamplingParams(temperature=0.8, top_k=5, seed=7, logprobs=2), 3, [1], [3],
                      [torch.Generator().manual_seed(7 + i) for i in range(3)]),
            SampleRow(SamplingParams(temperature=1.0, top_p=0.7, min_p=0.1), 1, [], [], None),
            SampleRow(SamplingParams(temperature=0, logprobs=4, repetition_penalty=1.2,
                                     presence_penalty=0.3), 2, [2, 3], [4], None, [5]),
            SampleRow(SamplingParams(temperature=1.0, logit_bias={9: 5.0}, logprobs=0), 1, [],
                      [], None),
            SampleRow(SamplingParams(temperature=0), 1, [], [], None)]
    tokens, logprobs = sample(logits, rows, torch.Generator().manual_seed(1))
    assert copies == ["tolist"]
    monkeypatch.undo()
    assert [len(t) for t in tokens] == [3, 1, 2, 1, 1]
    assert tokens[2] == [tokens[2][0]] * 2 and tokens[4] == [int(logits[4].argmax())]
    assert [len(e) if e else e for e in logprobs] == [3, None, 2, 1, None]
    assert [len(e[0].top) for e in logprobs if e] == [2, 4, 0]
    # Each entry's alternatives are the row's likeliest tokens, best first.
    ids, vals = zip(*logprobs[2][0].top)
    assert list(vals) == sorted(vals, reverse=True) and ids[0] == tokens[2][0]


def test_a_seeded_n_is_n_requests_seeded_one_apart(llm):
    """Sibling i of an n>1 request seeded s is the request seeded s + i, its first token
    too (sampled in the fork's row): what a P/D decode instance, which sends each sequence
    alone, and vLLM, which seeds its child requests so, give."""
    base = dict(max_tokens=6, temperature=1.0, ignore_eos=True)
    out = llm.generate(ids(llm, PROMPTS[:1]), SamplingParams(n=3, seed=40, **base),
                       use_tqdm=False)[0].outputs
    alone = [llm.generate(ids(llm, PROMPTS[:1]), SamplingParams(seed=40 + i, **base),
                          use_tqdm=False)[0].outputs[0].token_ids for i in range(3)]
    assert [o.token_ids for o in out] == alone
    assert len({t[0] for t in alone}) > 1  # the first tokens differ: each its own draw


def test_every_sibling_of_n_gets_its_first_tokens_logprobs(llm):
    """The step that ends an n>1 prompt samples every sibling's first token in one row:
    each sibling reports that token's logprob, and it is the logprob of its own token in
    the prompt's distribution (the one a greedy n=1 request sees, over the whole vocabulary
    here)."""
    vocab = llm.engine.core.vocab_size
    params = SamplingParams(max_tokens=5, n=3, temperature=1.0, seed=5, logprobs=vocab,
                            ignore_eos=True)
    out = llm.generate(ids(llm, PROMPTS[:1]), params, use_tqdm=False)[0]
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1
    greedy = llm.generate(ids(llm, PROMPTS[:1]), SamplingParams(
        max_tokens=1, temperature=0, logprobs=vocab), use_tqdm=False)[0].outputs[0]
    dist = dict(greedy.logprobs[0].top)
    for o in out.outputs:
        assert len(o.logprobs) == len(o.token_ids) == 5
        first = o.logprobs[0]
        assert first.logprob == pytest.approx(dist[o.token_ids[0]], abs=1e-5)
        assert [t for t, _ in first.top[:10]] == [t for t, _ in greedy.logprobs[0].top[:10]]
