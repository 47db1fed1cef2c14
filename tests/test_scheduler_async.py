"""The preemption handshake with an executor one step ahead, aborts, and output caching."""

from tidal.core import ModelOutput, Request, RequestStatus

from conftest import add, make_scheduler, sampled_for, scheduled, step


def _two_tight(async_scheduling=True):
    """bs 2, 4 blocks: a (4 tokens) and b (2 tokens) leave 1 block free; both need one for
    their first decode."""
    s = make_scheduler(num_blocks=4, block_size=2, clip_max_new_tokens=1,
                       async_scheduling=async_scheduling)
    a = add(s, "a", 4, max_tokens=20)
    b = add(s, "b", 2, max_tokens=20)
    return s, a, b


def test_preempted_request_waits_for_the_typed_ack_and_its_in_flight_token_is_dropped():
    s, a, b = _two_tight()
    out1 = s.schedule()
    assert set(scheduled(out1)) == {"a", "b"}
    out2 = s.schedule()  # planned before step 1's tokens arrive
    s.check_invariants()
    assert out2.preempted_ids == ["a"] and scheduled(out2) == {"b": (1, 2)}
    s.update(out1, ModelOutput(sampled={"a": [11], "b": [12]}))
    s.check_invariants()
    assert a.output_token_ids == [] and a.status is RequestStatus.PREEMPTED  # dropped
    assert b.output_token_ids == [12]
    out3 = s.schedule()
    assert "a" not in scheduled(out3) and a not in s.waiting  # no ack yet
    s.update(out2, ModelOutput(sampled={"b": [13]}, preempted_ack=["a"]))
    s.check_invariants()
    assert a.status is RequestStatus.WAITING and s.waiting == [a]
    s.update(out3, ModelOutput(sampled=sampled_for(s, out3)))
    s.abort("b")  # make room: a's prompt and b's reservation do not fit together
    out4 = s.schedule()
    assert scheduled(out4) == {"a": (4, 0)}  # recomputed from scratch, sampled once more
    s.update(out4, ModelOutput(sampled={"a": [21]}))
    assert a.output_token_ids == [21]


def test_an_executor_that_never_acks_keeps_the_request_out_of_the_queue():
    s, a, _ = _two_tight()
    out1 = s.schedule()
    out2 = s.schedule()
    s.update(out1, ModelOutput(sampled=sampled_for(s, out1)))
    for _ in range(3):
        out = s.schedule()
        s.update(out2, ModelOutput(sampled=sampled_for(s, out2)))
        out2 = out
        assert a.status is RequestStatus.PREEMPTED


def test_synchronous_executor_acks_by_finishing_the_step():
    s, a, b = _two_tight(async_scheduling=False)
    step(s)
    out, _ = step(s)
    assert out.preempted_ids == ["a"] and s.waiting == [a]


def test_async_decode_plans_the_placeholder_and_never_overshoots_max_tokens():
    """One step ahead, the scheduler plans a decode for a token still in flight, but never
    more tokens than max_tokens allows."""
    s = make_scheduler(num_blocks=16, block_size=4, async_scheduling=True)
    r = add(s, "a", 3, max_tokens=2)
    out1 = s.schedule()
    out2 = s.schedule()
    assert scheduled(out2) == {"a": (1, 3)} and r.num_in_flight == 2
    out3 = s.schedule()
    assert out3.kind == "idle"  # both allowed tokens are in flight
    s.update(out1, ModelOutput(sampled={"a": [5]}))
    outs = s.update(out2, ModelOutput(sampled={"a": [6]}))
    assert r.output_token_ids == [5, 6] and outs[-1].finish_reason == "length"
    s.update(out3, ModelOutput())
    s.check_invariants()
    assert not s.has_unfinished_requests()


def test_abort_from_every_state_frees_blocks_at_once():
    s = make_scheduler(num_blocks=32, block_size=2, chunked_prefill_size=4,
                       clip_max_new_tokens=1)
    add(s, "decoding", 3, max_tokens=30)
    step(s)
    add(s, "chunking", 12, max_tokens=30)
    add(s, "waiting", 12, max_tokens=30)
    out = s.schedule()
    assert s.active_prefill.request_id == "chunking" and s.requests["waiting"] in s.waiting
    for rid in ("chunking", "decoding", "waiting"):
        assert s.abort(rid)
        s.check_invariants()
    assert s.kv.num_free == 32 and not s.has_unfinished_requests()
    outs = s.update(out, ModelOutput(sampled={"decoding": [9]}))
    assert outs == []  # tokens of aborted requests are dropped
    assert s.schedule().finished_ids == ["chunking", "decoding", "waiting"]
    assert not s.abort("nobody")


def test_abort_of_a_preempted_request_drops_its_late_token():
    s, a, _ = _two_tight()
    out1 = s.schedule()
    out2 = s.schedule()
    assert s.abort("a")
    outs = s.update(out1, ModelOutput(sampled={"a": [1], "b": [2]}))
    assert [o.request_id for o in outs] == ["b"]
    s.update(out2, ModelOutput(sampled={"b": [3]}, preempted_ack=["a"]))
    s.check_invariants()
    assert "a" not in s.requests and not s.waiting


def test_output_tokens_are_cached_while_decoding():
    """Once a's output fills a block, a later prompt equal to a's prompt + output hits it."""
    s = make_scheduler(num_blocks=16, block_size=4)
    a = add(s, "a", 4, max_tokens=6, ignore_eos=True)
    while s.has_unfinished_requests():
        step(s)
    probe = Request("probe", a.all_token_ids + [1])
    assert len(s.kv.match_prefix(probe)) == 2  # prompt block + a block of outputs


def test_preempted_request_caches_nothing_from_late_results():
    s, a, _ = _two_tight()
    out1 = s.schedule()
    s.schedule()
    cached = s.kv.pool.num_cached
    s.update(out1, ModelOutput(sampled={"a": [1], "b": [2]}))
    # only b may publish blocks; a's prompt blocks were freed uncached
    assert len(s.kv.match_prefix(Request("p", a.prompt_token_ids + [0]))) == 0
    assert s.kv.pool.num_cached >= cached
