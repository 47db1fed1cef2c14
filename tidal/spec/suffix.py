"""`suffix`: suffix decoding (SuffixDecoding, Oliaro et al. 2024; vLLM's `suffix`). Guesses
follow the longest suffix of the sequence seen before, in the sequence itself (prompt and
output) or in the outputs of recent requests, token by token along the most frequent
continuation, for as long as the continuation stays likely: a long, often-repeated match
guesses many tokens, a weak one few or none. With `branches` > 1 the next most frequent
continuations grow as branches of a tree, likeliest first.

The suffix trees of the paper are kept here as counts of the token that follows each context
of 1 to `max_depth` tokens: the same matches up to that depth, in dictionaries."""

from __future__ import annotations

import heapq
from collections import Counter, deque

from tidal.spec.tree import GuessTree


class ContextCounts:
    """How often each token followed each context of 1..max_depth tokens."""

    def __init__(self, max_depth: int) -> None:
        self.max_depth = max_depth
        self.next: dict[tuple[int, ...], Counter] = {}

    def add(self, tokens: list[int], start: int = 0, sign: int = 1) -> None:
        """Count the continuations of tokens[start:] (sign -1: uncount them)."""
        depth, table = self.max_depth, self.next
        for i in range(max(start, 1), len(tokens)):
            token = tokens[i]
            for n in range(1, min(depth, i) + 1):
                key = tuple(tokens[i - n:i])
                counts = table.get(key)
                if counts is None:
                    counts = table[key] = Counter()
                counts[token] += sign
                if counts[token] <= 0:
                    del counts[token]
                    if not counts:
                        del table[key]


class SuffixProposer:
    """Per sequence, the counts of its own tokens; shared, those of the last
    `cache_requests` finished outputs. At each guessed position the longest context found
    (own counts first) gives the most frequent next token; guessing stops once the product
    of those tokens' frequencies falls under `min_prob`, or after `spec_factor` times the
    first match's length. With `branches` > 1, each node's `branches` most frequent next
    tokens are candidates, and the tree grows by the likeliest candidate (the product of
    frequencies along its path) until k nodes: one branch is the path above."""

    def __init__(self, max_depth: int = 8, min_prob: float = 0.1, spec_factor: float = 2.0,
                 cache_requests: int = 256, branches: int = 1) -> None:
        if branches < 1:
            raise ValueError(f"speculative_branches must be >= 1; got {branches}")
        self.max_depth, self.min_prob, self.spec_factor = max_depth, min_prob, spec_factor
        self.cache_requests, self.branches = cache_requests, branches
        self._own: dict[str, tuple[list[int], ContextCounts]] = {}
        self._shared = ContextCounts(max_depth)
        self._cached: deque[list[int]] = deque()

    def propose(self, seq_id: str, prompt: list[int], output: list[int], k: int) -> GuessTree:
        entry = self._own.get(seq_id)
        if entry is None:
            entry = self._own[seq_id] = (list(prompt), ContextCounts(self.max_depth))
            entry[1].add(entry[0])
        tokens, own = entry
        seen = len(tokens)
        tokens += output[seen - len(prompt):]
        own.add(tokens, seen)
        tree = GuessTree()
        window = tokens[-self.max_depth:]
        found = self._longest(window, own)
        if found is None:
            return tree
        depth_limit = min(k, max(1, int(self.spec_factor * found[0])))
        # candidates: (-path probability, order, parent node, its depth, token, window)
        heap: list = []
        order = 0

        def offer(counts: Counter, prob: float, parent: int, depth: int, ctx: list[int]):
            nonlocal order
            if depth >= depth_limit:
                return
            total = sum(counts.values())
            for token, count in counts.most_common(self.branches):
                p = prob * count / total
                if p >= self.min_prob:
                    heapq.heappush(heap, (-p, order, parent, depth + 1, token, ctx))
                    order += 1

        offer(found[1], 1.0, -1, 0, window)
        while heap and len(tree) < k:
            neg, _, parent, depth, token, ctx = heapq.heappop(heap)
            node = tree.add(parent, token)
            ctx = (ctx + [token])[-self.max_depth:]
            found = self._longest(ctx, own)
            if found is not None:
                offer(found[1], -neg, node, depth, ctx)
        return tree

    def _longest(self, window: list[int], own: ContextCounts) -> tuple[int, Counter] | None:
        """The longest suffix of window with a known continuation, and its counts (the
        sequence's own before the shared ones)."""
        tables = (own.next, self._shared.next)
        for n in range(len(window), 0, -1):
            key = tuple(window[-n:])
            for table in tables:
                counts = table.get(key)
                if counts:
                    return n, counts
        return None

    def forget(self, seq_id: str, output: list[int], finished: bool) -> None:
        self._own.pop(seq_id, None)
        if not finished or not output:
            return
        self._cached.append(list(output))
        self._shared.add(output)
        while len(self._cached) > self.cache_requests:
            self._shared.add(self._cached.popleft(), sign=-1)
