"""What the dispatcher remembers of the prompts it sent each core, for prefix-aware routing.
The core's own prefix cache is in another process; this is the dispatcher's estimate of it,
kept as the same chained hashes of full blocks and bounded like the core's pool."""

from __future__ import annotations

from collections import OrderedDict


def block_hashes(token_ids: list[int], block_size: int) -> list[int]:
    """One hash per full block, each covering the whole prefix up to its block's end."""
    out, h = [], 0
    for end in range(block_size, len(token_ids) + 1, block_size):
        h = hash((h, tuple(token_ids[end - block_size:end])))
        out.append(h)
    return out


class PrefixIndex:
    """Prefix blocks routed to one core, least recently used forgotten first."""

    def __init__(self, block_size: int, capacity: int) -> None:
        self.block_size, self.capacity = block_size, capacity
        self._blocks: OrderedDict[int, None] = OrderedDict()

    def match(self, hashes: list[int]) -> int:
        """Tokens of the prompt (given by its block hashes) the core probably caches."""
        n = 0
        for h in hashes:
            if h not in self._blocks:
                break
            n += 1
        return n * self.block_size

    def insert(self, hashes: list[int]) -> None:
        for h in hashes:
            self._blocks[h] = None
            self._blocks.move_to_end(h)
        while len(self._blocks) > self.capacity:
            self._blocks.popitem(last=False)
