"""LoRA adapters in the scheduler: at most max_loras of them hold blocks, requests of
resident adapters may pass one that waits for a slot only for lora_wait_steps, and a prefix
cached under one adapter is no hit for another."""

from hypothesis import given, settings, strategies as st

from conftest import add, make_scheduler, scheduled, step


def adapters_holding_blocks(s) -> set:
    return {r.lora for r in s.running if r.lora is not None}


def test_requests_of_resident_adapters_pass_one_that_waits_for_a_slot():
    s = make_scheduler(max_loras=1, lora_wait_steps=8)
    add(s, "a1", 4, max_tokens=20, lora="a")
    step(s)
    add(s, "b1", 4, max_tokens=4, lora="b")
    add(s, "a2", 4, max_tokens=4, lora="a")
    add(s, "base", 4, max_tokens=4)
    out, _ = step(s)
    assert set(scheduled(out)) == {"a1", "a2", "base"}  # b1 is skipped, not blocking
    assert [r.request_id for r in s.waiting] == ["b1"]
    assert adapters_holding_blocks(s) == {"a"}


def test_a_request_waiting_for_a_slot_stops_admission_after_lora_wait_steps():
    """A stream of 'a' requests would hold the one slot forever; after lora_wait_steps 'b'
    blocks the queue, the 'a' requests drain, and 'b' gets the slot."""
    s = make_scheduler(max_loras=1, lora_wait_steps=3)
    add(s, "a0", 4, max_tokens=6, lora="a")
    step(s)
    add(s, "b", 4, max_tokens=2, lora="b")
    admitted_at = None
    for i in range(1, 40):
        add(s, f"a{i}", 4, max_tokens=6, lora="a")
        out, _ = step(s)
        assert len(adapters_holding_blocks(s)) <= 1
        if "b" in scheduled(out):
            admitted_at = i
            break
    assert admitted_at is not None, "the 'b' request starved"
    # 3 steps of passing, then the last admitted 'a' (6 tokens) drains
    assert admitted_at <= 3 + 6 + 1


def test_max_loras_two_holds_two_adapters_and_the_base_model():
    s = make_scheduler(max_loras=2)
    for rid, lora in (("a", "x"), ("b", "y"), ("c", "z"), ("d", None), ("e", "x")):
        add(s, rid, 4, max_tokens=8, lora=lora)
    out, _ = step(s)
    assert set(scheduled(out)) == {"a", "b", "d", "e"}
    assert adapters_holding_blocks(s) == {"x", "y"}


def test_a_prefix_cached_under_one_adapter_is_no_hit_for_another():
    s = make_scheduler(max_loras=2, block_size=4)
    prompt = list(range(100, 117))  # four full blocks and one token
    add(s, "first", prompt, max_tokens=1, lora="a")
    step(s)
    for rid, lora, hit in (("other", "b", 0), ("base", None, 0), ("same", "a", 16)):
        add(s, rid, prompt, max_tokens=1, lora=lora)
        out, _ = step(s)
        assert scheduled(out)[rid] == (17 - hit, hit), rid
    assert not s.has_unfinished_requests()


def test_forked_siblings_keep_the_adapter_and_its_prefix_salt():
    s = make_scheduler(max_loras=1, block_size=4)
    parent = add(s, "p", list(range(9)), max_tokens=3, n=3, lora="a", temperature=1.0)
    step(s)
    children = [r for r in s.running if r.parent_id == "p"]
    assert len(children) == 2
    assert all(c.lora == "a" and c.extra_key == parent.extra_key for c in children)


@settings(max_examples=40, deadline=None)
@given(loras=st.lists(st.sampled_from([None, "a", "b", "c"]), min_size=1, max_size=12),
       max_loras=st.integers(1, 3), wait=st.integers(0, 5))
def test_every_request_finishes_and_no_step_exceeds_max_loras(loras, max_loras, wait):
    s = make_scheduler(max_loras=max_loras, lora_wait_steps=wait, num_blocks=32)
    for i, lora in enumerate(loras):
        add(s, f"r{i}", 3 + i % 5, max_tokens=1 + i % 4, lora=lora)
    for _ in range(200):
        if not s.has_unfinished_requests():
            break
        step(s)
        assert len(adapters_holding_blocks(s)) <= max_loras
    assert not s.has_unfinished_requests()
