"""`ngram`: prompt lookup. The sequence's last n tokens (n from prompt_lookup_max down to
prompt_lookup_min) are looked up among its earlier tokens, prompt and output; the tokens
that followed their latest earlier occurrence are the guess."""

from __future__ import annotations


class _Index:
    """One sequence's tokens and, per n, where each n-gram's latest occurrence ended."""

    __slots__ = ("tokens", "ends", "done")

    def __init__(self, prompt: list[int], sizes: range) -> None:
        self.tokens = list(prompt)
        self.ends: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in sizes}
        self.done = 0  # n-grams ending before this position are indexed


class NgramProposer:
    """Prompt lookup (vLLM's `ngram`): longest n-gram first, its latest occurrence wins.
    Indexing is incremental, so a step costs a few dictionary operations per new token."""

    def __init__(self, min_n: int, max_n: int) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"prompt_lookup_min must be in [1, prompt_lookup_max]; got "
                             f"{min_n} and {max_n}")
        self.sizes = range(min_n, max_n + 1)
        self._seqs: dict[str, _Index] = {}

    def propose(self, seq_id: str, prompt: list[int], output: list[int], k: int) -> list[int]:
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
                ends[tuple(tokens[e + 1 - n:e + 1])] = e + 1
        index.done = max(index.done, end)
        for n in reversed(self.sizes):
            if n > len(tokens):
                continue
            start = index.ends[n].get(tuple(tokens[-n:]))
            if start is not None:
                return tokens[start:start + k]
        return []

    def forget(self, seq_id: str, output: list[int], finished: bool) -> None:
        self._seqs.pop(seq_id, None)
