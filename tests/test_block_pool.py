"""BlockPool: reference counts, the exact-LRU free queue (lazy, with stale entries), and
its prefix-cache lookup."""

from __future__ import annotations

from collections import OrderedDict

import pytest
from hypothesis import given, settings, strategies as st

from tidal.core.block_pool import BlockPool


def test_pool_allocate_takes_from_front_of_free_queue():
    """allocate pops the oldest free blocks (front of the queue) and gives them ref 1."""
    pool = BlockPool(5)
    got = pool.allocate(2)
    assert [b.block_id for b in got] == [0, 1]
    assert [b.ref_cnt for b in got] == [1, 1]
    assert pool.free_block_ids() == [2, 3, 4]
    assert (pool.num_free, pool.num_used) == (3, 2)


def test_pool_release_appends_to_back_of_free_queue():
    """A block whose last reference is dropped joins the back, so it is reused last."""
    pool = BlockPool(5)
    b0, b1, b2 = pool.allocate(3)
    pool.release([b1])
    assert pool.free_block_ids() == [3, 4, 1]
    pool.release([b0])
    assert pool.free_block_ids() == [3, 4, 1, 0]
    assert [b.block_id for b in pool.allocate(2)] == [3, 4]
    assert pool.free_block_ids() == [1, 0]


def test_pool_touch_and_release_count_references():
    """touch adds a reference, release drops one; only ref 0 puts the block back in the queue."""
    pool = BlockPool(3)
    (b,) = pool.allocate(1)
    pool.touch([b])
    assert b.ref_cnt == 2
    pool.release([b])
    assert b.ref_cnt == 1 and 0 not in pool.free_block_ids()
    pool.release([b])
    assert b.ref_cnt == 0 and pool.free_block_ids() == [1, 2, 0]
    pool.touch([b])  # reviving a free block takes it out of the queue
    assert b.ref_cnt == 1 and pool.free_block_ids() == [1, 2]


def test_pool_allocate_more_than_free_raises_and_takes_nothing():
    """Asking for more blocks than are free raises and leaves the queue as it was."""
    pool = BlockPool(3)
    pool.allocate(2)
    with pytest.raises(RuntimeError):
        pool.allocate(2)
    assert pool.free_block_ids() == [2] and pool.blocks[2].ref_cnt == 0


@settings(max_examples=300, deadline=None)
@given(num_blocks=st.integers(1, 8), ops=st.lists(st.tuples(
    st.sampled_from(["allocate", "touch", "release", "lend"]), st.integers(0, 63),
    st.integers(1, 3)), max_size=120))
def test_pool_free_queue_is_an_exact_lru(num_blocks, ops):
    """Against an OrderedDict model: allocate takes the least recently freed blocks, touch
    revives a free block wherever it waits, release queues at the back, blocks lent (for a
    timing run) and given back return to the front. The pool's lazy queue (stale entries
    skipped, compacted when they pile up) must match it exactly."""
    pool = BlockPool(num_blocks)
    model: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # free ids
    held = [0] * num_blocks
    for op, i, n in ops:
        if op == "allocate":
            want = [model.popitem(last=False)[0] for _ in range(min(n, len(model)))]
            assert [b.block_id for b in pool.allocate(len(want))] == want
            for bid in want:
                held[bid] = 1
        elif op == "lend":
            want = [model.popitem(last=False)[0] for _ in range(min(n, len(model)))]
            lent = pool.allocate(len(want))
            assert [b.block_id for b in lent] == want
            pool.give_back(lent)
            for bid in reversed(want):
                model[bid] = None
                model.move_to_end(bid, last=False)
        elif op == "touch":  # a prefix hit or a fork: free or held alike
            bid = i % num_blocks
            pool.touch([pool.blocks[bid]])
            model.pop(bid, None)
            held[bid] += 1
        elif any(held):
            bid = [b for b in range(num_blocks) if held[b]][i % sum(map(bool, held))]
            pool.release([pool.blocks[bid]])
            held[bid] -= 1
            if not held[bid]:
                model[bid] = None
        assert pool.free_block_ids() == list(model)
        assert pool.num_free == len(model) and [b.ref_cnt for b in pool.blocks] == held
        assert len(pool._queue) <= 2 * num_blocks  # stale entries stay bounded
    assert [b.block_id for b in pool.allocate(len(model))] == list(model)  # drain it all


def test_only_blocks_fresh_from_allocate_are_given_back():
    pool = BlockPool(4)
    a, b = pool.allocate(2)
    pool.touch([a])  # a prefix hit or a fork: another holder
    with pytest.raises(ValueError):
        pool.give_back([a, b])
    assert (pool.num_free, a.ref_cnt, b.ref_cnt) == (2, 2, 1)
    pool.give_back([b])
    assert pool.free_block_ids() == [1, 2, 3]


def test_pool_compaction_forgets_the_stale_entries_of_blocks_in_use():
    """Block 0 is revived (its entry goes stale) while block 1 is revived and freed until
    the stale entries trigger a compaction; once freed again, block 0 must still be
    allocatable."""
    pool = BlockPool(2)
    a, b = pool.blocks
    pool.touch([a])
    for _ in range(3):
        pool.touch([b])
        pool.release([b])
    assert len(pool._queue) <= 2 and pool.free_block_ids() == [1]
    pool.release([a])
    assert pool.free_block_ids() == [1, 0]
    assert [x.block_id for x in pool.allocate(2)] == [1, 0]


def test_lookup_checks_tokens_not_just_hash():
    """A hash collision with different tokens is no hit, in lookup and in match_prefix."""
    pool = BlockPool(4)
    (blk,) = pool.allocate(1)
    pool.cache(blk, 12345, (1, 2))
    assert pool.lookup(12345, (1, 2)) is blk
    assert pool.lookup(12345, (1, 3)) is None
