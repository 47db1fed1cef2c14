"""`ngram`: prompt lookup. The sequence's last n tokens (n from prompt_lookup_max down to
prompt_lookup_min) are looked up among its earlier tokens, prompt and output; the tokens
that followed their latest earlier occurrence are the guess, and with `branches` > 1 those
after the next latest occurrences too, as branches of a tree where they part."""

from __future__ import annotations

from tidal.spec.tree import GuessTree


class _Index:
    """One sequence's tokens and, per n, where each n-gram's occurrences ended (oldest
    first)."""

    __slots__ = ("tokens", "ends", "done")

    def __init__(self, prompt: list[int], sizes: range) -> None:
        self.tokens = list(prompt)
        self.ends: dict[int, dict[tuple[int, ...], list[int]]] = {n: {} for n in sizes}
        self.done = 0  # n-grams ending before this position are indexed


class NgramProposer:
    """Prompt lookup (vLLM's `ngram`): longest n-gram first, its latest occurrence wins.
    With `branches` > 1 the latest `branches` occurrences each propose their continuation,
    merged into a tree (`merge`). Indexing is incremental,
    so a step costs a few dictionary operations per new token."""

    def __init__(self, min_n: int, max_n: int, branches: int = 1) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"prompt_lookup_min must be in [1, prompt_lookup_max]; got "
                             f"{min_n} and {max_n}")
        if branches < 1:
            raise ValueError(f"speculative_branches must be >= 1; got {branches}")
        self.sizes = range(min_n, max_n + 1)
        self.branches = branches
        self._seqs: dict[str, _Index] = {}

    def propose(self, seq_id: str, prompt: list[int], output: list[int], k: int) -> GuessTree:
        index = self._seqs.get(seq_id)
        if index is None:
            index = self._seqs[seq_id] = _Index(prompt, self.sizes)
        tokens = index.tokens
        tokens += output[len(tokens) - len(prompt):]
        end = len(tokens) - 1  # the last n-gram is the query: index those ending before it
        for e in range(index.done, end):
            for n, ends in index.ends.items():
                if n > e + 1:
                    break
                ends.setdefault(tuple(tokens[e + 1 - n:e + 1]), []).append(e + 1)
        index.done = max(index.done, end)
        for n in reversed(self.sizes):
            if n > len(tokens):
                continue
            starts = index.ends[n].get(tuple(tokens[-n:]))
            if starts:
                runs = [tokens[s:s + k] for s in reversed(starts[-self.branches:])]
                return merge(runs, k)
        return GuessTree()

    def forget(self, seq_id: str, output: list[int], finished: bool) -> None:
        self._seqs.pop(seq_id, None)


# How much less an ngram run is trusted than the later one before it, and each guess than
# the one before it on its run: recency and length, the proposer's only signs of a match.
RUN_WEIGHT = 0.5
DEPTH_DECAY = 0.8


def merge(runs: list[list[int]], k: int) -> GuessTree:
    """Token runs (the likeliest first) as a tree of their shared prefixes, best first: a
    node ranks by the weight of the runs through it (`RUN_WEIGHT` less per run), times
    `DEPTH_DECAY` per level below the first; at most k nodes."""
    total = sum(RUN_WEIGHT ** r for r in range(len(runs)))
    weight: dict[tuple[int, ...], float] = {}  # path -> weight of the runs through it
    for r, run in enumerate(runs):
        for d in range(1, len(run) + 1):
            path = tuple(run[:d])
            weight[path] = weight.get(path, 0.0) + RUN_WEIGHT ** r
    # a child's score is below its parent's, so every node comes after its parent
    order = sorted(weight, key=lambda path: -weight[path] / total * DEPTH_DECAY ** len(path))
    tree, index = GuessTree(), {(): -1}
    for path in order[:k]:
        index[path] = tree.add(index[path[:-1]], path[-1])
    return tree
