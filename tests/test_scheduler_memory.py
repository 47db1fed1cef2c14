"""Hand-computed cases for decode reservation, the ratio tracker, retraction and the guards."""

import pytest

from tidal.core import NewTokenRatio, Request, RequestStatus, SchedulerConfig

from conftest import add, make_scheduler, scheduled, step


def test_ratio_decays_linearly_over_600_decode_steps_to_its_floor():
    """init 0.7, floor 0.7 x 0.30 = 0.21, step (0.7 - 0.21) / 600 per decode-only step."""
    s = make_scheduler(num_blocks=128, block_size=16)
    add(s, "a", 1, max_tokens=2000, ignore_eos=True)
    out, _ = step(s)
    assert out.kind == "prefill" and s.ratio.value == pytest.approx(0.7)
    for _ in range(300):
        step(s)
    assert s.ratio.value == pytest.approx(0.7 - 300 * 0.49 / 600)
    for _ in range(300):
        step(s)
    assert s.ratio.value == pytest.approx(0.21)
    for _ in range(50):
        step(s)
    assert s.ratio.value == pytest.approx(0.21)  # never below the floor


def test_ratio_does_not_decay_while_a_request_waits():
    s = make_scheduler(num_blocks=8, block_size=4, max_num_seqs=1)
    add(s, "a", 2, max_tokens=50)
    add(s, "b", 2, max_tokens=50)  # blocked by max_num_seqs
    step(s)
    for _ in range(10):
        out, _ = step(s)
        assert out.kind == "decode"
    assert s.ratio.value == pytest.approx(0.7)


def test_ratio_resets_when_idle():
    s = make_scheduler(num_blocks=64, block_size=4)
    add(s, "a", 2, max_tokens=20, ignore_eos=True)
    while s.has_unfinished_requests():
        step(s)
    assert s.ratio.value < 0.7
    out, _ = step(s)
    assert out.kind == "idle" and s.ratio.value == pytest.approx(0.7)


def test_ratio_tracker_transitions():
    r = NewTokenRatio(SchedulerConfig(init_new_token_ratio=0.5, min_new_token_ratio_factor=0.5,
                                      new_token_ratio_decay_steps=5, retract_decode_steps=3))
    assert (r.init, r.min) == (0.5, 0.25)
    r.decay()
    assert r.value == pytest.approx(0.45)
    r.reset()
    assert r.value == 0.5


def _fill_three():
    """bs 2, 8 blocks: a (4 tokens), b (6), c (4) take 7 blocks; each has 1 output token and
    must take a new block for its next decode, but only 1 is free."""
    s = make_scheduler(num_blocks=8, block_size=2, clip_max_new_tokens=1)
    reqs = [add(s, "a", 4, max_tokens=50), add(s, "b", 6, max_tokens=50),
            add(s, "c", 4, max_tokens=50)]
    out, _ = step(s)
    assert set(scheduled(out)) == {"a", "b", "c"} and s.kv.num_free == 1
    return s, reqs


def test_retraction_takes_the_longest_prompt_among_the_shortest_outputs():
    """All outputs are 1 token long, so the longest prompt (b) goes first; freeing b's 3
    blocks covers a and c, so nobody else is retracted."""
    s, (a, b, c) = _fill_three()
    out, _ = step(s)
    assert out.preempted_ids == ["b"]
    assert set(scheduled(out)) == {"a", "c"}
    assert b.status is RequestStatus.WAITING and b.output_token_ids == [7]  # keeps its tokens
    assert s.stats().num_preemptions == 1


def test_ratio_after_retract_uses_the_requests_still_running():
    """After b is retracted: a and c have 1 output each of max 50:
    (1 + 1 + 20 * 2) / (50 + 50 + 1)."""
    s, _ = _fill_three()
    step(s)
    assert s.ratio.value == pytest.approx(42 / 101)


def test_retraction_takes_the_shortest_output_first():
    """a has decoded for a while; b and c join later with shorter outputs. Under pressure the
    victim is one of the newcomers (shortest output), the longer prompt of them first."""
    s = make_scheduler(num_blocks=10, block_size=2, clip_max_new_tokens=1)
    a = add(s, "a", 2, max_tokens=50)
    for _ in range(3):
        step(s)  # a: 2 prompt + 3 outputs, 3 blocks
    add(s, "b", 3, max_tokens=50)
    add(s, "c", 4, max_tokens=50)
    preempted = []
    while not preempted:
        out, _ = step(s)
        preempted = out.preempted_ids
    assert preempted[0] == "c" and a.status is RequestStatus.RUNNING


def test_retracted_request_rejoins_the_tail_and_recomputes_with_its_output():
    s, (a, b, c) = _fill_three()
    add(s, "d", 2, max_tokens=1)
    step(s)  # b retracted, rejoins after d
    assert [r.request_id for r in s.waiting] == ["d", "b"]
    while b.status is not RequestStatus.RUNNING:
        out, _ = step(s)
    # b's recompute covers its prompt and the token it already generated: 6 + 1 tokens
    assert sum(x.num_new_tokens for x in out.scheduled if x.request_id == "b") == 7 - b.num_cached_tokens


def test_outputs_report_the_prompt_hit_of_the_first_admission_alone():
    """cached_tokens (usage's) counts the prompt's tokens the prefix cache held when the
    request was first admitted; a readmission after retraction finds blocks it wrote itself,
    which it reports not. bs 2, 10 blocks: a and b (8 tokens each) outgrow the pool at
    their 11th token, b is retracted, a finishes and b comes back to its cached blocks.
    So does queue_seconds: from arrival to the first admission (a at 0 and b at 1, both
    admitted at 5; the clock moves on)."""
    now = [5.0]
    s = make_scheduler(num_blocks=10, block_size=2, clip_max_new_tokens=1,
                       clock=lambda: now[0])
    add(s, "a", 8, max_tokens=4, ignore_eos=True)
    b = add(s, "b", 8, max_tokens=8, ignore_eos=True)
    outputs, retracted = [], False
    while b.request_id in s.requests:
        out, got = step(s)
        outputs += got
        retracted = retracted or "b" in out.preempted_ids
        now[0] += 10.0
    assert retracted and b.num_cached_tokens == 8 and b.prompt_cached_tokens == 0
    assert {o.cached_tokens for o in outputs if o.request_id == "b"} == {0}
    assert {(o.request_id, o.queue_seconds) for o in outputs} == {("a", 5.0), ("b", 4.0)}
    e = add(s, "e", b.prompt_token_ids + [5, 6, 7], max_tokens=1)  # b's prompt, and more
    while e.request_id in s.requests:
        outputs = step(s)[1]
    assert e.prompt_cached_tokens == 8  # b's 4 prompt blocks of 2
    assert [o.cached_tokens for o in outputs if o.request_id == "e"] == [8]


def test_cached_free_blocks_are_evicted_before_anyone_is_retracted():
    """Blocks of a finished request stay cached while free; a decode that needs them evicts
    their hashes instead of retracting a running request."""
    s = make_scheduler(num_blocks=6, block_size=2, clip_max_new_tokens=1)
    old = add(s, "old", 8, max_tokens=1)
    step(s)
    assert s.stats().cached_blocks == 4 and s.kv.num_free == 6
    probe = Request("probe", old.prompt_token_ids + [1])
    assert len(s.kv.match_prefix(probe)) == 4
    add(s, "a", 3, max_tokens=20, ignore_eos=True)
    for _ in range(8):
        out, _ = step(s)
        assert not out.preempted_ids
    assert len(s.kv.match_prefix(probe)) < 4 and s.stats().num_preemptions == 0


def test_a_request_that_alone_outgrows_the_pool_finishes_with_length():
    """bs 2, 3 blocks: 4 prompt tokens + 2 outputs fill it; the next decode has nowhere to
    go and no one else to retract, so the request ends (no livelock)."""
    s = make_scheduler(num_blocks=3, block_size=2)
    r = add(s, "a", 4, max_tokens=10)
    outputs = []
    while s.has_unfinished_requests():
        _, outs = step(s)
        outputs += outs
    assert r.status is RequestStatus.FINISHED_LENGTH
    assert r.output_token_ids == [7, 7, 7]
    assert "KV cache" in r.finish_message and outputs[-1].finished


def test_safety_margin_stops_new_admissions_near_a_full_pool():
    """margin 0.5 of 10 blocks: a takes 3 (7 free >= 3 + 5); b would leave 4 < 5."""
    s = make_scheduler(num_blocks=10, block_size=4, safety_margin=0.5, clip_max_new_tokens=1)
    add(s, "a", 12, max_tokens=2)
    add(s, "b", 12, max_tokens=2)
    out, _ = step(s)
    assert set(scheduled(out)) == {"a"}
    assert [r.request_id for r in s.waiting] == ["b"]


def test_admission_reserves_running_decodes_output():
    """Running a (max 40, 0 out) reserves 40 x 0.7 = 28 tokens = 7 blocks of 4; with 16
    blocks, 2 held by a, b's 3 blocks + 7 + its own 28 x 0.7 ... do not fit: it waits."""
    s = make_scheduler(num_blocks=16, block_size=4)
    add(s, "a", 8, max_tokens=40)
    step(s)
    add(s, "b", 12, max_tokens=40)
    out, _ = step(s)
    # free 14 - reserve(a: 39 x 0.7 = 27.3) - own(b: 28) = ceil(55.3 / 4) = 14 blocks + 3 > 14
    assert "b" not in scheduled(out) and s.waiting[0].request_id == "b"


def test_a_request_alone_is_admitted_without_reserving_its_own_output():
    """Nothing running: the prompt's blocks suffice, though max_tokens x ratio would not."""
    s = make_scheduler(num_blocks=4, block_size=4)
    add(s, "a", 12, max_tokens=1000)
    out, _ = step(s)
    assert scheduled(out) == {"a": (12, 0)}


def test_newest_first_preemption_takes_the_last_admitted():
    """The vLLM-style order: with a, b, c admitted in that order and one block short, c goes
    (shortest_output, SGLang's and FastDeploy's order, would take b, the longest prompt among
    equal outputs)."""
    s = make_scheduler(num_blocks=8, block_size=2, clip_max_new_tokens=1,
                       preemption_order="newest")
    a, b, c = (add(s, "a", 4, max_tokens=50), add(s, "b", 6, max_tokens=50),
               add(s, "c", 4, max_tokens=50))
    step(s)
    out, _ = step(s)
    assert out.preempted_ids[0] == "c"
    assert c.status is RequestStatus.WAITING and b.status is RequestStatus.RUNNING
    assert a.status is RequestStatus.RUNNING


def test_ratio_zero_reserves_nothing_even_after_a_retraction():
    """init_new_token_ratio=0 turns reservation off: a request is admitted on its prompt's
    blocks alone, and a retraction does not turn reservation back on."""
    s = make_scheduler(num_blocks=8, block_size=2, init_new_token_ratio=0.0)
    add(s, "a", 4, max_tokens=50)
    add(s, "b", 6, max_tokens=50)
    add(s, "c", 4, max_tokens=50)
    out, _ = step(s)
    assert set(scheduled(out)) == {"a", "b", "c"}  # 7 of 8 blocks, no room kept for outputs
    preempted = []
    while not preempted:
        out, _ = step(s)
        preempted = out.preempted_ids
    assert s.ratio.value == 0.0


def test_preemption_order_is_validated():
    with pytest.raises(ValueError, match="preemption_order"):
        SchedulerConfig(preemption_order="oldest")
