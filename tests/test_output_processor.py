"""The frontend's OutputProcessor: n>1 siblings mapped back to their request, stop strings
ending a sequence, late tokens of an ended sequence dropped, a request ended early with the
text it has (`end`), and each output's logprobs on
its own update."""

from __future__ import annotations

from tidal.core import PromptLogprob, RequestOutput, SamplingParams, TokenLogprob
from tidal.engine.output_processor import OutputProcessor


class CharTokenizer:
    """Token t is the character chr(t): decoding is exact and incremental."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(t) for t in ids)


def out(rid, text, parent=None, finished=False, reason=None, index=0, **kwargs):
    return RequestOutput(rid, [ord(c) for c in text], finished, reason, None, parent, index,
                         **kwargs)


def test_a_sibling_ended_by_a_stop_string_is_not_started_again_by_its_late_tokens():
    p = OutputProcessor(CharTokenizer())
    p.track("r", SamplingParams(n=2, max_tokens=8, stop=["!"]))
    updates, stopped = p.process([out("r", "a"), out("r-1", "b!", parent="r", index=1)])
    assert stopped == ["r-1"]
    assert [(u.index, u.new_text, u.finished, u.finish_reason) for u in updates] == [
        (0, "a", False, None), (1, "b", True, "stop")]
    # the core ran one more step before it heard of the stop: that token is dropped
    updates, stopped = p.process([out("r", "c"), out("r-1", "x", parent="r", index=1)])
    assert [(u.index, u.finished) for u in updates] == [(0, False)] and stopped == []
    updates, _ = p.process([out("r", "d", finished=True, reason="length")])
    assert [(u.index, u.new_text, u.finish_reason) for u in updates] == [(0, "d", "length")]
    assert p._roots == {} and p._seqs == {}  # every sibling ended: nothing kept


def test_a_sibling_whose_first_token_comes_after_its_parent_finished_still_streams():
    p = OutputProcessor(CharTokenizer())
    p.track("r", SamplingParams(n=2, max_tokens=1))
    updates, _ = p.process([out("r", "a", finished=True, reason="length"),
                            out("r-1", "b", parent="r", index=1, finished=True, reason="length")])
    assert [(u.index, u.new_text, u.finished) for u in updates] == [(0, "a", True), (1, "b", True)]
    assert p._roots == {} and p._seqs == {}


def test_forget_drops_the_request_and_its_siblings():
    p = OutputProcessor(CharTokenizer())
    p.track("r", SamplingParams(n=3, max_tokens=4))
    p.process([out("r", "a"), out("r-1", "b", parent="r", index=1)])
    p.forget("r")
    updates, _ = p.process([out("r", "c"), out("r-2", "d", parent="r", index=2)])
    assert updates == [] and p._roots == {} and p._seqs == {}


def test_end_answers_each_unfinished_sequence_with_the_text_held_back():
    """An abort that answers: a live sequence ends with the text a partial stop string held
    back, one already ended is not ended again, a sibling never forked ends empty; then
    the request is forgotten and its late tokens start nothing."""
    p = OutputProcessor(CharTokenizer())
    p.track("r", SamplingParams(n=3, max_tokens=8, stop=["xyz"]))
    updates, _ = p.process([out("r", "abx"), out("r-1", "q", parent="r", index=1,
                                                  finished=True, reason="length")])
    shown = updates[0].new_text
    assert "x" not in shown and [u.index for u in updates] == [0, 1]  # "x" is held back
    ended = p.end("r", "abort", "cut short")
    assert [(u.index, u.new_token_ids, u.finished, u.finish_reason, u.finish_message,
             u.root_id) for u in ended] == [(0, [], True, "abort", "cut short", "r"),
                                             (2, [], True, "abort", "cut short", "r")]
    assert (shown + ended[0].new_text, ended[1].new_text) == ("abx", "")
    assert p._roots == {} and p._seqs == {}
    updates, _ = p.process([out("r", "c"), out("r-2", "d", parent="r", index=2)])
    assert updates == [] and p.end("r", "abort", None) == []


def test_two_outputs_of_one_sequence_in_a_batch_keep_their_own_logprobs():
    """A P/D first token landed beside the sequence's next decode: each update has its own
    output's entries, and the prompt logprobs go with the first only."""
    p = OutputProcessor(CharTokenizer())
    p.track("r", SamplingParams(max_tokens=8, logprobs=1, prompt_logprobs=0))
    first, second = TokenLogprob(-0.5, [(97, -0.5)]), TokenLogprob(-1.5, [(99, -0.2)])
    prompt = [None, PromptLogprob(-2.0, [], 3)]
    updates, _ = p.process([out("r", "a", logprobs=[first], prompt_logprobs=prompt),
                            out("r", "b", logprobs=[second])])
    assert [(u.new_text, u.logprobs, u.prompt_logprobs) for u in updates] == [
        ("a", [first], prompt), ("b", [second], None)]


def test_a_siblings_index_is_the_outputs_field_whatever_its_id():
    p = OutputProcessor(CharTokenizer())
    p.track("r", SamplingParams(n=3, max_tokens=4))
    updates, _ = p.process([out("r", "a"), out("other-name", "b", parent="r", index=2)])
    assert [(u.request_id, u.root_id, u.index) for u in updates] == [
        ("r", "r", 0), ("other-name", "r", 2)]


def test_an_outputs_message_carries_typed_logprobs_across_msgpack():
    """Outputs as the core sends them over ZMQ: the logprobs decode as their structs on the
    outputs they belong to (a sibling's first token's too), and a plain output stays bare."""
    from tidal.engine import messages as m

    prompt = [None, PromptLogprob(-2.25, [(5, -0.75), (7, -1.5)], 3)]
    sent = m.Outputs(1, [
        out("r", "a", logprobs=[TokenLogprob(-0.5, [(97, -0.5), (98, -2.0)])],
            prompt_logprobs=prompt),
        out("r-1", "b", parent="r", index=1, logprobs=[TokenLogprob(-2.0, [(97, -0.5)])]),
        out("q", "c", finished=True, reason="length")], incarnation=2)
    got = m.from_core.decode(m.encoder.encode(sent))
    assert got == sent
    first, sibling, plain = got.outputs
    assert isinstance(first.logprobs[0], TokenLogprob) and first.logprobs[0].top[1] == (98, -2.0)
    assert isinstance(first.prompt_logprobs[1], PromptLogprob)
    assert first.prompt_logprobs[1].rank == 3
    assert (sibling.index, sibling.logprobs[0].logprob) == (1, -2.0)
    assert plain.logprobs is None and plain.prompt_logprobs is None
    p = OutputProcessor(CharTokenizer())
    p.track("r", SamplingParams(n=2, max_tokens=4, logprobs=2, prompt_logprobs=2))
    p.track("q", SamplingParams(max_tokens=1))
    updates, _ = p.process(got.outputs)
    assert [(u.index, u.logprobs, u.prompt_logprobs) for u in updates] == [
        (0, first.logprobs, prompt), (1, sibling.logprobs, None), (0, None, None)]
