"""Block tables per request on top of the block pool: allocate, free, fork, prefix match."""

from __future__ import annotations

from tidal.core.block_pool import Block, BlockPool, hash_block
from tidal.core.config import CacheConfig
from tidal.core.kv_tiers import KVTiers
from tidal.core.request import Request


_CHAIN_BROKEN = 1 << 62  # a table whose chain hit a hash collision publishes no more


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Owns every request's block table (a list of block ids). All changes to block
    ownership go through here. With `tiers`, every block published to the prefix cache is
    stored in the tier below the pool too, and `match_tier` finds a prefix there."""

    def __init__(self, config: CacheConfig, tiers: KVTiers | None = None) -> None:
        self.config, self.tiers = config, tiers
        self.block_size = config.block_size
        self.pool = BlockPool(config.num_blocks, config.enable_prefix_caching)
        self.tables: dict[str, list[int]] = {}
        self._num_cached: dict[str, int] = {}  # leading blocks of each table already hashed

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free(self) -> int:
        return self.pool.num_free

    def block_ids(self, request_id: str) -> list[int]:
        """The request's block table. Tables only grow at the tail until freed, so an
        executor may keep the list it was handed for the step it was handed for."""
        return self.tables.get(request_id, [])

    def _blocks(self, ids: list[int]) -> list[Block]:
        return [self.pool.blocks[i] for i in ids]

    # ------------------------------------------------------------------ prefix matching
    def _hashes(self, request: Request, num_blocks: int) -> list[int]:
        """Chain hashes covering at least the first `num_blocks` full blocks (memoised with
        the blocks' token tuples in `request.block_tokens`, so the list may hold more:
        callers slice)."""
        hashes, done = request.block_hashes, len(request.block_hashes)
        if done < num_blocks:
            bs, extra = self.block_size, request.extra_key
            flat = request.token_slice(done * bs, num_blocks * bs)
            # Many blocks (a prompt) are cut in one C-level pass (zip over one iterator); the
            # one block a decode fills is cheaper as a plain tuple.
            blocks = list(zip(*[iter(flat)] * bs)) if num_blocks - done > 1 else [tuple(flat)]
            parent = hashes[-1] if hashes else None
            for block in blocks:
                parent = hash_block(parent, block, extra)
                hashes.append(parent)
            request.block_tokens += blocks
        return hashes

    def keeps_prefix(self, request: Request) -> bool:
        """Whether the request's computed full blocks are cached and read back: retracted,
        it resumes from them."""
        return self.pool.enable_prefix_caching and request.reads_prefix_cache

    def match_prefix(self, request: Request) -> list[Block]:
        """Cached blocks holding a prefix of the request's tokens, capped so at least one
        token is left to compute, and empty for a request that may not read the cache (it
        owes prompt logprobs). Takes no reference."""
        if not self.keeps_prefix(request):
            return []
        max_blocks = (request.num_tokens - 1) // self.block_size
        if max_blocks == 0:
            return []
        hit: list[Block] = []
        parent = None
        hashes, tokens = self._hashes(request, max_blocks), request.block_tokens
        for i in range(max_blocks):
            block = self.pool.lookup(hashes[i], tokens[i], (parent, request.extra_key))
            if block is None:
                break
            hit.append(block)
            parent = hashes[i]
        return hit

    def match_tier(self, request: Request, hit: int) -> list[bytes]:
        """Keys of the blocks after the pool's `hit` blocks that the tier below holds, in a
        run, capped so at least one token is left to compute; empty where the request may
        not read the cache or loaded once already."""
        tiers = self.tiers
        if (tiers is None or request.tier_loading is not None
                or not self.keeps_prefix(request)):
            return []
        max_blocks = (request.num_tokens - 1) // self.block_size
        if hit >= max_blocks:
            return []
        self._hashes(request, max_blocks)  # the blocks' tokens
        return tiers.run(request, hit, max_blocks)

    # ------------------------------------------------------------------ allocation
    def blocks_needed(self, request: Request, num_tokens: int, hit: list[Block] = ()) -> int:
        """Free blocks that allocate() would take: new blocks plus cached hits now free."""
        if hit:
            new = cdiv(len(hit) * self.block_size + num_tokens, self.block_size) - len(hit)
            return new + sum(1 for b in hit if b.ref_cnt == 0)
        held = len(self.tables.get(request.request_id, ()))
        return max(0, cdiv(request.num_computed_tokens + num_tokens, self.block_size) - held)

    def allocate(self, request: Request, num_tokens: int, hit: list[Block] = ()) -> bool:
        """Grow the request's table to cover `num_tokens` more tokens after those computed
        (or after `hit`, the prefix blocks from match_prefix, for a request holding none).
        Returns False and changes nothing when blocks are short."""
        need = self.blocks_needed(request, num_tokens, hit)
        if need > self.pool.num_free:
            return False
        table = self.tables.setdefault(request.request_id, [])
        start = request.num_computed_tokens
        if hit:
            assert not table, "a prefix hit is only taken by a request holding no blocks"
            self.pool.touch(hit)
            table.extend(b.block_id for b in hit)
            self._num_cached[request.request_id] = len(hit)
            start = len(hit) * self.block_size
        missing = cdiv(start + num_tokens, self.block_size) - len(table)
        if missing > 0:
            table += [b.block_id for b in self.pool.allocate(missing)]
        return True

    def append_slot(self, request: Request) -> list[int] | None:
        """Make room for one more token (a decode): a new block only when the last is full.
        Returns the table, or None (nothing changed) when no block is free."""
        table = self.tables[request.request_id]
        if request.num_computed_tokens >= len(table) * self.block_size:
            if not self.pool.num_free:
                return None
            table.append(self.pool.allocate(1)[0].block_id)
        return table

    def trim(self, request: Request) -> None:
        """Give back the tail blocks that hold none of the request's computed tokens (the
        lookahead of rejected guesses). They were never published: only blocks of computed
        tokens are."""
        table = self.tables[request.request_id]
        keep = cdiv(request.num_computed_tokens, self.block_size)
        if len(table) > keep:
            tail = table[keep:]
            del table[keep:]
            self.pool.release(map(self.pool.blocks.__getitem__, reversed(tail)))

    def free(self, request: Request) -> None:
        """Give back every block of the request, tail first (heads stay cached longest)."""
        table = self.tables.pop(request.request_id, None)
        self._num_cached.pop(request.request_id, None)
        if table:
            self.pool.release(map(self.pool.blocks.__getitem__, reversed(table)))

    def cache_computed(self, request: Request, num_tokens: int) -> None:
        """Publish the request's full blocks whose KV covers its first `num_tokens` tokens."""
        if not self.pool.enable_prefix_caching:
            return
        rid = request.request_id
        table = self.tables.get(rid)
        if not table:
            return
        done = self._num_cached.get(rid, 0)
        full = min(num_tokens, request.num_tokens, len(table) * self.block_size) // self.block_size
        if full <= done:
            return
        hashes, tokens = self._hashes(request, full), request.block_tokens
        blocks, cache, extra = self.pool.blocks, self.pool.cache, request.extra_key
        keys = self.tiers.keys(request, full) if self.tiers else None
        parent = hashes[done - 1] if done else None
        for i in range(done, full):
            if not cache(blocks[table[i]], hashes[i], tokens[i], (parent, extra)):
                full = _CHAIN_BROKEN  # a collision: nothing after it may be published
                break
            if keys is not None:
                self.tiers.stored(table[i], keys[i])
            parent = hashes[i]
        self._num_cached[rid] = full

    def reset_prefix_cache(self) -> int:
        """Forget every prefix the pool has cached (the tiers below keep theirs): a later
        prompt is computed anew; running requests go on publishing their new blocks.
        Returns how many blocks were forgotten."""
        return self.pool.reset_prefix_cache()

    def fork(self, parent: Request, child: Request, num_tokens: int) -> list[tuple[int, int]] | None:
        """Give `child` the parent's KV for its first `num_tokens` tokens: full blocks are
        shared, a partial last block is copied into a fresh one.

        Returns the (src, dst) block copies the executor must do before the child's next
        step, or None (nothing changed) when no fresh block is free."""
        table = self.tables[parent.request_id]
        full, partial = divmod(num_tokens, self.block_size)
        if partial and self.pool.num_free < 1:
            return None
        shared = table[:full]
        self.pool.touch(self._blocks(shared))
        child_table = list(shared)
        self.tables[child.request_id] = child_table
        done = self._num_cached.get(parent.request_id, 0)
        # A broken chain stays broken: the child's later blocks would chain on the collision.
        self._num_cached[child.request_id] = done if done == _CHAIN_BROKEN else min(done, full)
        if not partial:
            return []
        fresh = self.pool.allocate(1)[0]
        child_table.append(fresh.block_id)
        return [(table[full], fresh.block_id)]
