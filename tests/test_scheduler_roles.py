"""Batch modes, roles (mixed / prefill / decode), n>1 forks, stop conditions, bad input."""

import pytest

from tidal.core import ModelOutput, Request, RequestStatus, SamplingParams

from conftest import EOS, add, make_scheduler, scheduled, step


def _decoding_plus_newcomer(batch_mode):
    s = make_scheduler(num_blocks=32, block_size=4, batch_mode=batch_mode)
    add(s, "a", 3, max_tokens=10)
    step(s)
    add(s, "b", 5, max_tokens=10)
    out, _ = step(s)
    return out


def test_separate_mode_runs_no_decode_in_a_prefill_step():
    out = _decoding_plus_newcomer("separate")
    assert out.kind == "prefill" and scheduled(out) == {"b": (5, 0)}


def test_mixed_mode_shares_a_step_between_decodes_and_prefill():
    out = _decoding_plus_newcomer("mixed")
    assert out.kind == "mixed" and scheduled(out) == {"a": (1, 3), "b": (5, 0)}


def test_prefill_role_preallocates_chunks_many_under_the_full_budget_and_hands_off():
    s = make_scheduler(num_blocks=32, block_size=4, role="prefill", chunked_prefill_size=4,
                       max_input_tokens_per_step=16)
    a = add(s, "a", 12, max_tokens=10)
    b = add(s, "b", 12, max_tokens=10)
    out, outs = step(s)
    # no one-chunk rule and no chunk cap: a whole (12), b an aligned 4 of the rest
    assert scheduled(out) == {"a": (12, 0), "b": (4, 0)}
    assert len(s.kv.block_ids("b")) == 3  # b's whole prompt was allocated up front
    assert a.status is RequestStatus.TRANSFERRING and outs[0].kv_transfer
    assert outs[0].new_token_ids == [7] and not outs[0].finished
    out, outs = step(s)
    assert scheduled(out) == {"b": (8, 4)} and b.status is RequestStatus.TRANSFERRING
    s.kv_sent("a")
    s.kv_sent("b")
    s.check_invariants()
    assert s.kv.num_free == 32 and not s.has_unfinished_requests()


def test_prefill_role_finishes_locally_when_the_first_token_ends_the_request():
    s = make_scheduler(role="prefill")
    r = add(s, "a", 5, max_tokens=1)
    _, outs = step(s)
    assert r.status is RequestStatus.FINISHED_LENGTH and outs[0].finished
    assert not outs[0].kv_transfer


def test_decode_role_reserves_blocks_for_incoming_kv_then_decodes():
    s = make_scheduler(num_blocks=32, block_size=4, role="decode")
    r = add(s, "a", 10, max_tokens=5)
    out = s.schedule()
    s.check_invariants()
    assert out.scheduled == [] and out.transfer_ids == ["a"]
    assert r.status is RequestStatus.TRANSFERRING and len(s.kv.block_ids("a")) == 3
    s.update(out, ModelOutput())
    s.kv_received("a", 42)
    out, _ = step(s)
    assert scheduled(out) == {"a": (1, 10)} and r.output_token_ids == [42, 7]


def test_n_greater_than_one_forks_after_the_prompt_sharing_full_blocks():
    """Prompt 6 tokens, bs 4: siblings share block 0 and copy the partial block 1."""
    s = make_scheduler(num_blocks=32, block_size=4)
    add(s, "p", 6, max_tokens=3, n=3)
    out = s.schedule()
    outs = s.update(out, ModelOutput(sampled={"p": [5, 6, 7]}))
    s.check_invariants()
    assert {(o.request_id, o.parent_id, o.index, tuple(o.new_token_ids)) for o in outs} == {
        ("p", None, 0, (5,)), ("p-1", "p", 1, (6,)), ("p-2", "p", 2, (7,))}
    assert [s.requests[rid].index for rid in ("p", "p-1", "p-2")] == [0, 1, 2]
    out = s.schedule()
    later = s.update(out, ModelOutput(sampled={"p": [8], "p-1": [9], "p-2": [10]}))
    assert {(o.request_id, o.index) for o in later} == {("p", 0), ("p-1", 1), ("p-2", 2)}
    tables = {rid: s.kv.block_ids(rid) for rid in ("p", "p-1", "p-2")}
    assert tables["p"][0] == tables["p-1"][0] == tables["p-2"][0]
    assert s.kv.pool.blocks[tables["p"][0]].ref_cnt == 3
    assert len({t[1] for t in tables.values()}) == 3
    assert sorted(out.block_copies) == sorted((tables["p"][1], tables[c][1]) for c in ("p-1", "p-2"))
    assert scheduled(out) == {"p": (1, 6), "p-1": (1, 6), "p-2": (1, 6)}
    s.check_invariants()
    s.abort("p")  # aborting the parent ends its siblings too
    assert not s.has_unfinished_requests() and s.kv.num_free == 32


def test_stop_conditions():
    s = make_scheduler()
    eos = add(s, "eos", 3, max_tokens=10)
    ign = add(s, "ignore", 3, max_tokens=2, ignore_eos=True)
    stop = add(s, "stop", 3, max_tokens=10, ignore_eos=True, stop_token_ids=[EOS])
    step(s, token=EOS)
    assert eos.status is RequestStatus.FINISHED_STOPPED and eos.finish_reason == "stop"
    assert stop.status is RequestStatus.FINISHED_STOPPED  # stop ids apply despite ignore_eos
    assert ign.status is RequestStatus.RUNNING
    step(s, token=EOS)
    assert ign.finish_reason == "length" and ign.output_token_ids == [EOS, EOS]


def test_max_model_len_ends_a_request_with_length():
    s = make_scheduler(max_model_len=6)
    r = add(s, "a", 4, max_tokens=100)
    while s.has_unfinished_requests():
        step(s)
    assert r.finish_reason == "length" and r.num_tokens == 6


def test_bad_requests_get_clear_errors():
    s = make_scheduler(num_blocks=4, block_size=4, max_model_len=64)
    with pytest.raises(ValueError, match="KV blocks"):
        add(s, "big", 16)
    with pytest.raises(ValueError, match="max_model_len"):
        add(s, "long", 64)
    add(s, "x", 2)
    with pytest.raises(ValueError, match="already in use"):
        add(s, "x", 2)
    with pytest.raises(ValueError, match="at least one token"):
        Request("e", [])
    for bad in ({"max_tokens": 0}, {"temperature": -1}, {"top_p": 0}, {"n": 0}):
        with pytest.raises(ValueError):
            SamplingParams(**bad)


def test_executor_without_a_token_fails_the_request_not_the_engine():
    s = make_scheduler()
    add(s, "a", 3)
    out = s.schedule()
    outs = s.update(out, ModelOutput())
    assert outs[0].finish_reason == "error" and not s.has_unfinished_requests()
