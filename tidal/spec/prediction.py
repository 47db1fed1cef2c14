"""OpenAI's predicted outputs: a request's `prediction` holds tokens its output is expected
to repeat (most of a file that comes back edited). Where the engine speculates, its guesses
come from the prediction first: the prediction's start before any output, then what
follows the place the output's last 2-4 tokens match it. Verification keeps the output exactly
what it would be without a prediction; a good one only makes it come sooner."""

from __future__ import annotations

from tidal.spec.tree import GuessTree

MAX_N = 4  # the longest output tail looked up in the prediction (tried first)
MIN_N = 2  # the shortest: one token matches too many places to guess from


class _Indexed:
    """One prediction: where each n-gram of it ends (ascending), and where the last match
    ended, so the output walks the prediction forward."""

    __slots__ = ("tokens", "ends", "last")

    def __init__(self, tokens: list[int]) -> None:
        self.tokens = tokens
        self.ends: dict[tuple[int, ...], list[int]] = {}
        for n in range(MIN_N, MAX_N + 1):
            for end in range(n, len(tokens) + 1):
                self.ends.setdefault(tuple(tokens[end - n:end]), []).append(end)
        self.last = 0


class PredictionLookup:
    """Guesses from each sequence's prediction; none where the output left it."""

    def __init__(self) -> None:
        self._seqs: dict[str, _Indexed] = {}

    def propose(self, seq_id: str, prediction: list[int], output: list[int],
                k: int) -> GuessTree:
        """Up to k tokens of the prediction to follow `output` (empty: no match)."""
        seq = self._seqs.get(seq_id)
        if seq is None:
            seq = self._seqs[seq_id] = _Indexed(list(prediction))
        if not output:
            return GuessTree.chain(seq.tokens[:k])
        for n in range(min(MAX_N, len(output)), MIN_N - 1, -1):
            ends = seq.ends.get(tuple(output[-n:]), ())
            end = next((e for e in ends if e >= seq.last), None)  # forward, never back
            if end is not None and end < len(seq.tokens):
                seq.last = end
                return GuessTree.chain(seq.tokens[end:end + k])
        return GuessTree()

    def forget(self, seq_id: str) -> None:
        self._seqs.pop(seq_id, None)
