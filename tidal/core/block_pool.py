"""The pool of KV blocks: ref counts, an LRU free queue, and the prefix-cache hash map."""

from __future__ import annotations

from collections import deque
from typing import Hashable, Iterable


def hash_block(parent_hash: int | None, token_ids: tuple[int, ...], extra_key: Hashable) -> int:
    """Chain hash of a full block: equal only if the whole prefix before it is equal too."""
    return hash((parent_hash, token_ids, extra_key))


class Block:
    """One KV block. `block_hash`, `token_ids` and `context` (parent hash, extra key) are set
    once it is full and cached: a hit must match all of them, not the hash alone."""

    __slots__ = ("block_id", "ref_cnt", "block_hash", "token_ids", "context", "queued")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: int | None = None
        self.token_ids: tuple[int, ...] | None = None
        self.context: Hashable = None
        self.queued = 0  # its entries in the pool's free queue; only the newest one counts

    def __repr__(self) -> str:
        return f"Block({self.block_id}, ref={self.ref_cnt}, cached={self.block_hash is not None})"


class BlockPool:
    """Fixed set of blocks. Free blocks wait in least-recently-used order; a free block that
    still holds a cached prefix keeps its hash until a fresh block is needed."""

    def __init__(self, num_blocks: int, enable_prefix_caching: bool = True) -> None:
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Oldest first: the front is evicted first. A free block taken back by a prefix hit
        # keeps its entry (no removal from the middle): an entry counts only while its block
        # is free and no newer entry of it follows (`Block.queued`); allocate skips the rest.
        self._queue: deque[Block] = deque(self.blocks)
        for block in self.blocks:
            block.queued = 1
        self._num_free = num_blocks
        self._cached: dict[int, Block] = {}
        self.num_evictions = 0

    @property
    def num_free(self) -> int:
        """Blocks a new allocation can take, cached-but-unreferenced ones included."""
        return self._num_free

    @property
    def num_used(self) -> int:
        return self.num_blocks - self._num_free

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    def free_block_ids(self) -> list[int]:
        """Free block ids in eviction order (next evicted first)."""
        newest: dict[int, None] = {}  # each free block at its newest entry, back to front
        for block in reversed(self._queue):
            if block.ref_cnt == 0 and block.block_id not in newest:
                newest[block.block_id] = None
        return list(newest)[::-1]

    def allocate(self, n: int) -> list[Block]:
        """Take `n` fresh blocks (ref 1), evicting the least recently used cached ones."""
        if n > self._num_free:
            raise RuntimeError(f"asked for {n} blocks with {self._num_free} free")
        out: list[Block] = []
        pop = self._queue.popleft
        while len(out) < n:
            block = pop()
            block.queued -= 1
            if block.ref_cnt or block.queued:
                continue  # a stale entry: taken by a prefix hit, or queued again later
            if block.block_hash is not None:  # the least recently used cached prefix goes
                del self._cached[block.block_hash]
                block.block_hash = block.token_ids = block.context = None
                self.num_evictions += 1
            block.ref_cnt = 1
            out.append(block)
        self._num_free -= n
        return out

    def touch(self, blocks: Iterable[Block]) -> None:
        """Take a reference on blocks found in the cache (or shared by a fork)."""
        for block in blocks:
            if block.ref_cnt == 0:
                self._num_free -= 1  # its queue entry is now stale
            block.ref_cnt += 1

    def release(self, blocks: Iterable[Block]) -> None:
        """Drop a reference; a block nobody holds joins the back of the free queue.

        Callers pass a request's blocks tail first, so the tail of a prefix is evicted before
        its head (a head block serves every request that shares the prefix)."""
        queue = self._queue
        for block in blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                block.queued += 1
                queue.append(block)
                self._num_free += 1
        if len(queue) > 2 * self.num_blocks:
            self._compact()

    def give_back(self, blocks: list[Block]) -> None:
        """Return blocks that `allocate` gave and nobody else took a reference on, their
        contents worthless (a timing run's): to the front of the free queue, in order, so
        they are taken again before any cached prefix is evicted."""
        if any(b.ref_cnt != 1 or b.queued for b in blocks):
            raise ValueError("give_back takes blocks fresh from allocate, held once")
        for block in reversed(blocks):
            block.ref_cnt, block.queued = 0, 1
            self._queue.appendleft(block)
        self._num_free += len(blocks)

    def _compact(self) -> None:
        """Drop the stale entries (prefix hits on free blocks leave them behind)."""
        live = [self.blocks[i] for i in self.free_block_ids()]
        for block in self._queue:
            block.queued = 0
        for block in live:
            block.queued = 1
        self._queue = deque(live)

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix (vLLM's reset_prefix_cache): no later prompt finds
        one. Blocks in use keep their KV for the requests holding them. Returns how many
        blocks were forgotten."""
        for block in self._cached.values():
            block.block_hash = block.token_ids = block.context = None
        forgotten = len(self._cached)
        self._cached.clear()
        return forgotten

    def lookup(self, block_hash: int, token_ids: tuple[int, ...],
               context: Hashable = None) -> Block | None:
        """The cached block for this hash, if its tokens and context (parent hash, extra key)
        really match: a hash collision is never a hit."""
        block = self._cached.get(block_hash)
        if block is None or block.token_ids != token_ids or block.context != context:
            return None
        return block

    def cache(self, block: Block, block_hash: int, token_ids: tuple[int, ...],
              context: Hashable = None) -> bool:
        """Publish a full block for prefix reuse. A block already cached, or a prefix
        another block already serves, is left as it is. Returns False on a hash collision
        (another block holds this hash for other content): blocks chained after this one
        must not be published under it."""
        if not self.enable_prefix_caching or block.block_hash is not None:
            return True
        other = self._cached.get(block_hash)
        if other is not None:
            return other.token_ids == token_ids and other.context == context
        block.block_hash = block_hash
        block.token_ids = token_ids
        block.context = context
        self._cached[block_hash] = block
        return True
