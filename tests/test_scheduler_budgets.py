"""Hand-computed cases for chunking and the two per-step token budgets."""

from tidal.core import Admission, StepBudget

from conftest import add, make_scheduler, scheduled, step


def test_step_budget_whole_requests_spend_only_input_tokens():
    """A request that fits both budgets is taken whole and leaves rem_chunk_tokens alone."""
    b = StepBudget(chunk_tokens=8, input_tokens=20, block_size=4)
    assert b.chunk_size(0, 6) == 6
    b.spend(6, chunked=False)
    assert (b.rem_chunk_tokens, b.rem_input_tokens) == (8, 14)
    assert b.chunk_size(0, 30) == 8  # too long: the largest block-aligned chunk
    b.spend(8, chunked=True)
    assert (b.rem_chunk_tokens, b.rem_input_tokens) == (0, 6)
    assert b.chunk_size(0, 3) == 0  # rem_chunk is spent, so nothing fits any more


def test_chunk_is_block_aligned_after_a_cached_prefix():
    """prefix + chunk ends on a block boundary: 8 cached + floor((8+10)/4)*4 - 8 = 8."""
    s = make_scheduler(num_blocks=64, block_size=4, chunked_prefill_size=10)
    add(s, "a", [1] * 8 + [5], max_tokens=1)
    step(s)  # a: 9 tokens whole; its two full blocks are cached
    assert not s.has_unfinished_requests()
    add(s, "b", [1] * 8 + [9] * 20, max_tokens=1)
    out, _ = step(s)
    assert scheduled(out) == {"b": (8, 8)}  # 8 hit, chunk 8 ends at 16
    assert s.stats().prefix_hit_tokens == 8
    out, _ = step(s)
    assert scheduled(out) == {"b": (8, 16)}  # floor((16+10)/4)*4 - 16
    out, _ = step(s)
    assert scheduled(out) == {"b": (4, 24)} and out.scheduled[0].samples  # the rest, whole


def test_whole_requests_are_admitted_until_rem_input_tokens_runs_out():
    """Prompts of 6 with rem_input 20: three fit whole (6+6+6=18); the fourth would need a
    chunk of min(8, 2) aligned down to 0 tokens, so admission stops."""
    s = make_scheduler(block_size=4, chunked_prefill_size=8, max_input_tokens_per_step=20,
                       clip_max_new_tokens=1)
    for rid in "abcd":
        add(s, rid, 6)
    out, _ = step(s)
    assert scheduled(out) == {"a": (6, 0), "b": (6, 0), "c": (6, 0)}
    assert [r.request_id for r in s.waiting] == ["d"]


def test_running_decodes_come_off_rem_input_tokens():
    """Three decoding requests leave 12 - 3 = 9 input tokens: a 9-token prompt fits whole."""
    s = make_scheduler(block_size=4, chunked_prefill_size=16, max_input_tokens_per_step=12,
                       clip_max_new_tokens=1)
    for rid in "abc":
        add(s, rid, 2, max_tokens=10)
    step(s)
    add(s, "d", 9)
    out, _ = step(s)
    assert scheduled(out)["d"] == (9, 0)
    add(s, "e", 10)  # 10 > 12 - 4: chunked to floor(8/4)*4 = 8
    out, _ = step(s)
    assert scheduled(out)["e"] == (8, 0)


def test_at_most_one_chunked_prefill_and_it_goes_first():
    """Two long prompts: only the first is chunked; it is served first every step until its
    last chunk, and only then may the second start chunking."""
    s = make_scheduler(num_blocks=64, block_size=4, chunked_prefill_size=8,
                       max_input_tokens_per_step=64, clip_max_new_tokens=1)
    add(s, "a", 20, max_tokens=4)
    add(s, "b", 20, max_tokens=4)
    out, _ = step(s)
    assert scheduled(out) == {"a": (8, 0)} and s.active_prefill.request_id == "a"
    out, _ = step(s)
    assert scheduled(out) == {"a": (8, 8)}
    out, _ = step(s)  # a's last 4 tokens finish its prefill: b may start chunking
    assert scheduled(out) == {"a": (4, 16), "b": (8, 0)}
    assert s.active_prefill.request_id == "b"


def test_short_requests_join_while_a_long_one_holds_the_chunk_slot():
    """The continuing chunk spends rem_input_tokens only, so a waiting request that fits whole
    is still admitted; one that would need a second chunk stops admission (FIFO)."""
    s = make_scheduler(num_blocks=64, block_size=4, chunked_prefill_size=8,
                       max_input_tokens_per_step=64, clip_max_new_tokens=1)
    add(s, "long", 30, max_tokens=2)
    step(s)
    add(s, "short", 3, max_tokens=2)
    add(s, "long2", 30, max_tokens=2)
    add(s, "short2", 3, max_tokens=2)
    out, _ = step(s)
    assert scheduled(out) == {"long": (8, 8), "short": (3, 0)}
    assert [r.request_id for r in s.waiting] == ["long2", "short2"]


def test_max_num_seqs_caps_requests_holding_blocks():
    s = make_scheduler(block_size=4, max_num_seqs=2, clip_max_new_tokens=1)
    for rid in "abc":
        add(s, rid, 3, max_tokens=5)
    out, _ = step(s)
    assert set(scheduled(out)) == {"a", "b"}
    assert [r.request_id for r in s.waiting] == ["c"]


def test_admission_outcomes_are_named():
    assert {a.name for a in Admission} == {"ADMITTED", "NO_MEMORY", "BUDGET_EXHAUSTED",
                                           "NO_ADAPTER_SLOT"}
