"""KVCacheManager: block tables, prefix matching and caching, forks (the pool alone:
test_block_pool.py)."""

from __future__ import annotations

from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

import tidal.core.kv_cache_manager as kvm
from tidal.core.block_pool import hash_block
from tidal.core.config import CacheConfig
from tidal.core.kv_cache_manager import KVCacheManager, cdiv
from tidal.core.request import Request, SamplingParams


def mgr(num_blocks: int = 8, block_size: int = 4) -> KVCacheManager:
    return KVCacheManager(CacheConfig(num_blocks=num_blocks, block_size=block_size))


def req(rid: str, tokens, extra_key=None) -> Request:
    return Request(rid, list(tokens), SamplingParams(max_tokens=4), extra_key=extra_key)


def prefill(kv: KVCacheManager, r: Request) -> None:
    """Allocate the whole prompt, mark it computed and publish its full blocks."""
    assert kv.allocate(r, r.num_tokens)
    r.num_computed_tokens = r.num_tokens
    kv.cache_computed(r, r.num_tokens)


def refs(kv: KVCacheManager) -> list[int]:
    return [b.ref_cnt for b in kv.pool.blocks]


def snapshot(kv: KVCacheManager):
    pool = kv.pool
    return ({k: list(v) for k, v in kv.tables.items()}, pool.free_block_ids(), refs(kv),
            dict(kv._num_cached), {h: b.block_id for h, b in pool._cached.items()},
            [(b.block_hash, b.token_ids) for b in pool.blocks], pool.num_evictions)


def test_manager_free_releases_tail_first():
    """free() releases a table tail first, so a prefix's tail sits ahead of its head."""
    kv = mgr(8, 4)
    a, b = req("a", range(1, 11)), req("b", range(20, 25))
    assert kv.allocate(a, 10) and kv.allocate(b, 5)
    assert kv.block_ids("a") == [0, 1, 2] and kv.block_ids("b") == [3, 4]
    kv.free(a)
    assert kv.pool.free_block_ids() == [5, 6, 7, 2, 1, 0]
    kv.free(b)
    assert kv.pool.free_block_ids() == [5, 6, 7, 2, 1, 0, 4, 3]
    assert refs(kv) == [0] * 8 and kv.tables == {}
    assert kv.allocate(req("x", range(16)), 16) and kv.block_ids("x") == [5, 6, 7, 2]


# ------------------------------------------------------------------ prefix caching
def test_chain_hash_same_block_after_different_prefix_misses():
    """A full block's hash chains on its parent: equal tokens after another prefix do not hit."""
    kv = mgr(8, 4)
    prefill(kv, req("a", [1, 2, 3, 4, 5, 6, 7, 8, 9]))
    h1 = hash_block(None, (1, 2, 3, 4), None)
    assert kv.pool.blocks[0].block_hash == h1
    assert kv.pool.blocks[1].block_hash == hash_block(h1, (5, 6, 7, 8), None)
    other = hash_block(hash_block(None, (9, 9, 9, 9), None), (5, 6, 7, 8), None)
    assert other != kv.pool.blocks[1].block_hash and other not in kv.pool._cached
    assert kv.match_prefix(req("b", [9, 9, 9, 9, 5, 6, 7, 8, 9])) == []
    assert [b.block_id for b in kv.match_prefix(req("c", [1, 2, 3, 4, 5, 6, 7, 8, 0]))] == [0, 1]


def collide(monkeypatch, victim: tuple, parent, tokens: tuple) -> None:
    """Make the manager hash block `tokens` after `parent` exactly like block `victim`."""
    real = kvm.hash_block
    monkeypatch.setattr(kvm, "hash_block", lambda p, t, k: real(*victim) if (p, t) ==
                        (parent, tokens) else real(p, t, k))


def test_match_prefix_rejects_hash_collision_with_other_tokens(monkeypatch):
    """Two first blocks with equal hashes but other tokens: the second request misses."""
    collide(monkeypatch, (None, (5, 5), None), None, (7, 8))
    kv = mgr(4, 2)
    prefill(kv, req("a", [5, 5, 0]))
    r = req("r", [7, 8, 9])
    assert kv._hashes(r, 1)[0] == kv.pool.blocks[0].block_hash  # a real collision
    assert kv.match_prefix(r) == []


def test_match_prefix_rejects_block_written_after_colliding_parent(monkeypatch):
    """A block is hit only if written after the very prefix looked up, not an equal hash."""
    collide(monkeypatch, (None, (1, 2), None), None, (5, 6))
    kv = mgr(8, 2)
    prefill(kv, req("r", [1, 2, 3, 4, 0]))  # blocks 0, 1 cached
    prefill(kv, req("w", [5, 6, 7, 8, 0]))  # block 3 (5, 6) collides: stays uncached
    # ... and so does block 4 after it: publishing it would chain it on block 0's hash.
    assert kv.pool.blocks[3].block_hash is None and kv.pool.blocks[4].block_hash is None
    # [1, 2, 7, 8]: block 0 is right; block 4 (KV of (7, 8) after (5, 6)) must not hit.
    assert [b.block_id for b in kv.match_prefix(req("x", [1, 2, 7, 8, 0]))] == [0]


def test_fork_child_of_a_broken_chain_publishes_nothing_after_it(monkeypatch):
    """A fork inherits a collision in its shared prefix: its own later blocks stay unpublished."""
    collide(monkeypatch, (None, (1, 2), None), None, (5, 6))
    kv = mgr(8, 2)
    prefill(kv, req("r", [1, 2, 3, 4, 0]))  # blocks 0, 1 cached
    w = req("w", [5, 6, 7, 8, 0])
    prefill(kv, w)  # blocks [3, 4, 5]; block 3 collides, so nothing of w is published
    c = req("c", [5, 6, 7, 8, 0])
    assert kv.fork(w, c, 2) == [] and kv.block_ids("c") == [3]
    c.num_computed_tokens = 2
    assert kv.allocate(c, 2) and kv.block_ids("c") == [3, 6]
    c.num_computed_tokens = 4
    kv.cache_computed(c, 4)  # block 6: KV of (7, 8) after (5, 6)
    assert kv.pool.blocks[6].block_hash is None
    assert [b.block_id for b in kv.match_prefix(req("x", [1, 2, 7, 8, 0]))] == [0]


def test_cached_free_blocks_keep_hash_and_lru_cached_block_is_evicted_first():
    """Freed cached blocks stay hittable; a fresh allocation evicts the LRU one first."""
    kv = mgr(4, 2)
    a, b = req("a", [1, 2, 3]), req("b", [5, 6, 7])
    prefill(kv, a)  # blocks [0, 1], block 0 cached
    kv.free(a)
    assert kv.pool.free_block_ids() == [2, 3, 1, 0]
    prefill(kv, b)  # blocks [2, 3], block 2 cached
    kv.free(b)
    assert kv.pool.free_block_ids() == [1, 0, 3, 2] and kv.pool.num_cached == 2
    # Re-use a's prefix: block 0 is revived (1 fresh block, the uncached 1, is taken).
    a2 = req("a2", [1, 2, 8])
    hit = kv.match_prefix(a2)
    assert [b.block_id for b in hit] == [0] and kv.blocks_needed(a2, 1, hit) == 2
    assert kv.allocate(a2, 1, hit) and kv.block_ids("a2") == [0, 1]
    assert kv.pool.num_cached == 2 and kv.pool.num_evictions == 0
    kv.free(a2)
    assert kv.pool.free_block_ids() == [3, 2, 1, 0]
    # Two fresh blocks: 3 (uncached), then 2 -- b's block, now the least recently used.
    assert kv.allocate(req("c", [7, 7, 7, 7]), 4) and kv.block_ids("c") == [3, 2]
    assert kv.pool.num_cached == 1 and kv.pool.num_evictions == 1
    assert kv.match_prefix(req("b?", [5, 6, 9])) == []
    assert [b.block_id for b in kv.match_prefix(req("a?", [1, 2, 9]))] == [0]


def test_extra_key_separates_caches():
    """Requests with another extra_key (tenant, adapter) never share prefix blocks."""
    kv = mgr(8, 4)
    prefill(kv, req("a", range(1, 10), extra_key="t1"))
    assert kv.match_prefix(req("b", range(1, 10), extra_key="t2")) == []
    assert kv.match_prefix(req("c", range(1, 10))) == []
    assert [b.block_id for b in kv.match_prefix(req("d", range(1, 10), extra_key="t1"))] == [0, 1]


def test_extra_key_with_colliding_hash_does_not_share_cache():
    """extra_key is verified, not trusted by hash: keys -1 and -2 must not share blocks."""
    kv = mgr(8, 4)
    prefill(kv, req("a", range(1, 10), extra_key=-1))
    assert kv.match_prefix(req("b", range(1, 10), extra_key=-2)) == []


# ------------------------------------------------------------------ allocate
def test_allocate_short_returns_false_and_changes_nothing():
    """allocate without enough free blocks returns False: tables, refs and queue untouched."""
    kv = mgr(4, 4)
    prefill(kv, req("old", [1, 2, 3, 4, 5]))  # cached block 0, then freed
    kv.free(req("old", [1]))
    a = req("a", range(50, 62))
    assert kv.allocate(a, 12)  # takes 2, 3, 1: the cached block 0 stays free
    a.num_computed_tokens = 12
    before = snapshot(kv)
    assert not kv.allocate(a, 8)  # needs 2 more blocks, 1 free
    assert not kv.allocate(req("b", range(70, 78)), 8)
    assert snapshot(kv) == before and "b" not in kv.tables
    # With a prefix hit: 1 revived + 1 fresh block are needed, only 1 is free.
    c = req("c", [1, 2, 3, 4, 9, 9])
    hit = kv.match_prefix(c)
    assert [b.block_id for b in hit] == [0] and kv.blocks_needed(c, 2, hit) == 2
    assert not kv.allocate(c, 2, hit)
    assert snapshot(kv) == before and kv.pool.blocks[0].ref_cnt == 0


def test_allocate_grows_from_num_computed_tokens():
    """Without a hit, allocate covers num_computed_tokens + n and only adds missing blocks."""
    kv = mgr(8, 4)
    r = req("r", range(10))
    assert kv.allocate(r, 4) and kv.block_ids("r") == [0]
    r.num_computed_tokens = 4
    assert kv.blocks_needed(r, 1) == 1 and kv.allocate(r, 1) and kv.block_ids("r") == [0, 1]
    assert kv.blocks_needed(r, 4) == 0 and kv.allocate(r, 4) and kv.block_ids("r") == [0, 1]
    assert kv.blocks_needed(r, 5) == 1 and kv.num_free == 6


def test_allocate_with_hit_references_and_revives_blocks():
    """A hit takes references on its blocks, revives free ones, and blocks_needed counts them."""
    kv = mgr(8, 4)
    prefill(kv, req("a", range(1, 10)))  # blocks 0, 1 cached; 2 partial
    kv.free(req("a", [1]))
    assert kv.pool.free_block_ids() == [3, 4, 5, 6, 7, 2, 1, 0]
    b = req("b", list(range(1, 9)) + [100, 101])
    hit = kv.match_prefix(b)
    assert [x.block_id for x in hit] == [0, 1]
    assert kv.blocks_needed(b, 2, hit) == 3  # 1 new + 2 revived
    assert kv.allocate(b, 2, hit) and kv.block_ids("b") == [0, 1, 3]
    assert refs(kv)[:4] == [1, 1, 0, 1] and kv.pool.free_block_ids() == [4, 5, 6, 7, 2]
    c = req("c", list(range(1, 9)) + [200, 201])
    hit = kv.match_prefix(c)
    assert kv.blocks_needed(c, 2, hit) == 1  # hit blocks are held: nothing to revive
    assert kv.allocate(c, 2, hit) and kv.block_ids("c") == [0, 1, 4]
    assert refs(kv)[:5] == [2, 2, 0, 1, 1] and kv.num_free == 4


def test_a_salted_prefix_is_a_hit_only_under_its_salt():
    """cache_salt (vLLM's): a tenant's blocks are found by requests of its salt alone, and
    its salt keys every block, not the first only (a later block's hash chains the salt)."""
    kv = mgr(16, 4)

    def salted(rid: str, salt: str | None) -> Request:
        return Request(rid, list(range(1, 10)), SamplingParams(max_tokens=4, cache_salt=salt))
    prefill(kv, salted("a", "tenant-1"))
    assert len(kv.match_prefix(salted("b", "tenant-1"))) == 2
    assert kv.match_prefix(salted("c", "tenant-2")) == []
    assert kv.match_prefix(salted("d", None)) == []
    prefill(kv, salted("e", None))
    assert len(kv.match_prefix(salted("f", None))) == 2
    assert kv.match_prefix(salted("g", "tenant-2")) == []


# ------------------------------------------------------------------ match_prefix cap
def test_match_prefix_leaves_at_least_one_token():
    """match_prefix covers at most len(tokens) - 1 tokens, in whole blocks."""
    kv = mgr(8, 4)
    prefill(kv, req("a", range(1, 9)))  # exactly 2 full blocks, both cached
    assert kv.pool.num_cached == 2
    assert [b.block_id for b in kv.match_prefix(req("b", range(1, 9)))] == [0]
    assert [b.block_id for b in kv.match_prefix(req("c", list(range(1, 9)) + [0]))] == [0, 1]
    assert kv.match_prefix(req("d", range(1, 5))) == []


def test_match_prefix_cap_holds_with_memoised_hashes():
    """The len - 1 cap also holds for a re-admitted request whose full blocks were hashed."""
    kv = mgr(8, 4)
    r = req("r", range(1, 9))
    prefill(kv, r)  # cache_computed hashed (memoised) both full blocks
    kv.free(r)
    r.num_computed_tokens = 0
    assert [b.block_id for b in kv.match_prefix(r)] == [0]


# ------------------------------------------------------------------ cache_computed
def test_cache_computed_publishes_only_full_computed_blocks_idempotently():
    """cache_computed(r, n) hashes the full blocks inside the first n tokens, once."""
    kv = mgr(8, 4)
    r = req("r", range(1, 11))
    assert kv.allocate(r, 10) and kv.block_ids("r") == [0, 1, 2]
    kv.cache_computed(r, 3)
    assert kv.pool.num_cached == 0
    kv.cache_computed(r, 7)
    assert kv.pool.num_cached == 1 and kv.pool.blocks[0].token_ids == (1, 2, 3, 4)
    kv.cache_computed(r, 10)
    assert kv.pool.num_cached == 2 and kv.pool.blocks[2].block_hash is None
    before = snapshot(kv)
    kv.cache_computed(r, 10)
    kv.cache_computed(r, 100)  # capped by the request's 10 tokens
    kv.cache_computed(r, 4)
    assert snapshot(kv) == before


# ------------------------------------------------------------------ fork
def test_fork_shares_full_blocks_and_copies_partial_block():
    """fork shares full blocks (ref 2) and copies the partial last one into a fresh block."""
    kv = mgr(8, 4)
    p = req("p", range(1, 11))
    assert kv.allocate(p, 10)
    p.num_computed_tokens = 10
    assert kv.fork(p, req("c", range(1, 11)), 10) == [(2, 3)]
    assert kv.block_ids("c") == [0, 1, 3]
    assert refs(kv)[:4] == [2, 2, 1, 1] and kv.num_free == 4
    kv.free(p)  # the child still holds the shared blocks
    assert refs(kv)[:4] == [1, 1, 0, 1] and kv.pool.free_block_ids() == [4, 5, 6, 7, 2]


def test_fork_block_aligned_copies_nothing():
    """A block-aligned fork only shares: no copy, no fresh block."""
    kv = mgr(8, 4)
    p = req("p", range(1, 11))
    assert kv.allocate(p, 10)
    assert kv.fork(p, req("c", range(1, 9)), 8) == []
    assert kv.block_ids("c") == [0, 1] and refs(kv)[:3] == [2, 2, 1] and kv.num_free == 5


def test_fork_without_free_block_returns_none_and_changes_nothing():
    """A fork that needs a copy but finds no free block returns None and changes nothing."""
    kv = mgr(3, 4)
    p = req("p", range(1, 11))
    assert kv.allocate(p, 10) and kv.num_free == 0
    before = snapshot(kv)
    assert kv.fork(p, req("c", range(1, 11)), 10) is None
    assert snapshot(kv) == before and "c" not in kv.tables
    assert kv.fork(p, req("d", range(1, 9)), 8) == [] and refs(kv) == [2, 2, 1]


def test_fork_child_publishes_its_own_blocks():
    """A child counts only the shared full blocks as cached, so it publishes its own later."""
    kv = mgr(8, 4)
    p = req("p", range(1, 14))
    prefill(kv, p)  # blocks [0, 1, 2, 3]; 0..2 cached
    c = req("c", [1, 2, 3, 4, 5, 6, 99, 99, 7])
    assert kv.fork(p, c, 6) == [(1, 4)] and kv.block_ids("c") == [0, 4]
    c.num_computed_tokens = 8
    kv.cache_computed(c, 8)
    assert kv.pool.blocks[4].token_ids == (5, 6, 99, 99)
    d = req("d", [1, 2, 3, 4, 5, 6, 99, 99, 0])
    assert [b.block_id for b in kv.match_prefix(d)] == [0, 4]


# ------------------------------------------------------------------ property test
class KVMachine(RuleBasedStateMachine):
    """Random arrivals/admissions (with or without a prefix hit), growth, caching, free or
    preemption, and forks; every admitted hit must hold exactly the requested prefix."""

    @initialize(num_blocks=st.one_of(st.integers(4, 12), st.integers(4, 64)), block_size=st.integers(2, 16),
                bases=st.lists(st.lists(st.integers(1, 3), min_size=48, max_size=48),
                               min_size=2, max_size=2))
    def setup(self, num_blocks, block_size, bases):
        self.kv = mgr(num_blocks, block_size)
        self.bs, self.bases, self.n = block_size, bases, 0
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.owner: dict[int, tuple[Request, int]] = {}  # block -> (who wrote it, its index)

    def _new_blocks(self, r: Request, old_len: int) -> None:
        for i, bid in enumerate(self.kv.block_ids(r.request_id)[old_len:], old_len):
            self.owner[bid] = (r, i)

    def _grow(self, r: Request, n: int, hit=()) -> bool:
        kv, held = self.kv, len(self.kv.block_ids(r.request_id))
        need, free, before = kv.blocks_needed(r, n, hit), kv.num_free, snapshot(kv)
        if not kv.allocate(r, n, hit):
            assert need > free and snapshot(kv) == before
            return False
        assert kv.num_free == free - need
        self._new_blocks(r, held + len(hit))
        r.num_computed_tokens = (len(hit) * self.bs if hit else r.num_computed_tokens) + n
        return True

    def _admit(self, r: Request, use_hit: bool, frac: float) -> None:
        hit = self.kv.match_prefix(r) if use_hit else []
        assert len(hit) <= (r.num_tokens - 1) // self.bs  # at least one token to compute
        for j, b in enumerate(hit):  # a hit holds exactly this prefix, written by its owner
            o, oi = self.owner[b.block_id]
            assert oi == j and o.extra_key == r.extra_key
            assert o.all_token_ids[:(j + 1) * self.bs] == r.all_token_ids[:(j + 1) * self.bs]
        rest = r.num_tokens - len(hit) * self.bs
        assert rest >= 1
        if self._grow(r, 1 + int(frac * (rest - 1)), hit):
            self.waiting.remove(r)
            self.running.append(r)
            if frac > 0.3:  # usually publish what was computed, as the scheduler does
                self.kv.cache_computed(r, r.num_computed_tokens)

    @rule(base=st.sampled_from([0, 0, 1]), m=st.integers(0, 48), suffix=st.lists(
          st.integers(4, 6), max_size=5), key=st.sampled_from([None, None, "t"]),
          use_hit=st.booleans(), frac=st.floats(0, 1))
    def arrive(self, base, m, suffix, key, use_hit, frac):
        self.n += 1
        r = req(f"r{self.n}", self.bases[base][:m] + suffix or [9], extra_key=key)
        self.waiting.append(r)
        self._admit(r, use_hit, frac)

    @rule(i=st.integers(0, 99), use_hit=st.booleans(), frac=st.floats(0, 1))
    def readmit(self, i, use_hit, frac):
        if self.waiting:  # (no preconditions: a filtered first step would abort examples)
            self._admit(self.waiting[i % len(self.waiting)], use_hit, frac)

    @rule(i=st.integers(0, 99), frac=st.floats(0, 1), token=st.integers(1, 3),
          cache=st.booleans())
    def grow(self, i, frac, token, cache):
        if not self.running:
            return
        r = self.running[i % len(self.running)]
        if r.num_computed_tokens == r.num_tokens:
            if len(r.output_token_ids) == r.max_tokens:  # done: publish and free
                self.free(self.running.index(r), preempt=False, cache_first=True)
                return
            r.output_token_ids.append(token)  # decode one token
        if self._grow(r, 1 + int(frac * (r.num_tokens - r.num_computed_tokens - 1))) and cache:
            self.kv.cache_computed(r, r.num_computed_tokens)

    @rule(i=st.integers(0, 99), frac=st.floats(0, 1))
    def cache(self, i, frac):
        if not self.running:
            return
        r = self.running[i % len(self.running)]
        self.kv.cache_computed(r, int(frac * r.num_computed_tokens))

    @rule(i=st.integers(0, 99), preempt=st.booleans(), cache_first=st.booleans())
    def free(self, i, preempt, cache_first):
        if not self.running:
            return
        r = self.running.pop(i % len(self.running))
        if cache_first:
            self.kv.cache_computed(r, r.num_computed_tokens)
        self.kv.free(r)
        assert r.request_id not in self.kv.tables
        if preempt:
            r.num_computed_tokens = 0
            self.waiting.append(r)

    @rule(i=st.integers(0, 99), frac=st.floats(0, 1), token=st.integers(4, 6))
    def fork(self, i, frac, token):
        parents = [r for r in self.running if r.num_computed_tokens]
        if not parents:
            return
        p = parents[i % len(parents)]
        k = 1 + int(frac * (p.num_computed_tokens - 1))
        self.n += 1
        child = req(f"r{self.n}", p.all_token_ids[:k] + [token], extra_key=p.extra_key)
        free, before = self.kv.num_free, snapshot(self.kv)
        copies = self.kv.fork(p, child, k)
        if copies is None:
            assert k % self.bs and free == 0 and snapshot(self.kv) == before
            return
        full = k // self.bs
        ptable, ctable = self.kv.block_ids(p.request_id), self.kv.block_ids(child.request_id)
        assert ctable[:full] == ptable[:full] and len(ctable) == cdiv(k, self.bs)
        assert copies == ([(ptable[full], ctable[full])] if k % self.bs else [])
        assert self.kv.num_free == free - len(copies)
        self._new_blocks(child, full)
        child.num_computed_tokens = k
        self.running.append(child)

    @rule()
    def reset_prefix_cache(self):
        """Nothing cached is found after it; what requests hold stays theirs."""
        kv, before = self.kv, snapshot(self.kv)
        cached = kv.pool.num_cached
        assert kv.reset_prefix_cache() == cached and kv.pool.num_cached == 0
        assert all(b.block_hash is None for b in kv.pool.blocks)
        assert snapshot(kv)[:3] == before[:3]  # tables, the free queue, references
        for r in self.running:
            assert kv.match_prefix(r) == []  # a prompt seen before finds nothing

    @invariant()
    def blocks_are_accounted_for(self):
        kv, pool = self.kv, self.kv.pool
        assert pool.num_free + pool.num_used == pool.num_blocks
        assert set(kv.tables) == {r.request_id for r in self.running}
        held = [0] * pool.num_blocks
        for r in self.running:
            table = kv.block_ids(r.request_id)
            assert len(set(table)) == len(table)
            assert len(table) == cdiv(r.num_computed_tokens, self.bs)
            for bid in table:
                held[bid] += 1
        free = pool.free_block_ids()
        assert len(set(free)) == len(free)
        for b in pool.blocks:
            assert b.ref_cnt == held[b.block_id]
            assert (b.block_id in free) == (held[b.block_id] == 0)
        assert pool.num_free == sum(1 for h in held if h == 0)
        for h, b in pool._cached.items():
            assert b.block_hash == h and len(b.token_ids) == self.bs
        assert sum(b.block_hash is not None for b in pool.blocks) == pool.num_cached


KVMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=50, deadline=None)
test_kv_cache_state_machine = KVMachine.TestCase
