"""The interface every speculative proposer implements (`factory.py` makes them).

A proposer guesses the tokens that follow a sequence; the model verifies the guesses in one
forward pass. Proposers run beside the model runner (they see every sequence's tokens as it
samples them) and are keyed by sequence id; they never see a scheduler.

EAGLE and MTP heads plug in the same way: a proposer that keeps the target model's last
hidden state per sequence (the runner would hand it over with the sampled tokens) and runs
its head k times from it; its `propose` reads that state instead of the token history.
"""

from __future__ import annotations

from typing import Protocol

from tidal.spec.tree import GuessTree


class Proposer(Protocol):
    """Guesses up to k tokens that follow a sequence's prompt and output: one path, or a
    tree of candidate continuations (`tree.py`)."""

    def propose(self, seq_id: str, prompt: list[int], output: list[int], k: int) -> GuessTree:
        """At most k guessed tokens to follow prompt + output, best first (empty: no
        guess). Called with the same sequence's output grown by appends only, until
        `forget`."""
        ...

    def forget(self, seq_id: str, output: list[int], finished: bool) -> None:
        """The sequence left the runner: finished (its output may inform later guesses) or
        retracted (it comes back with its tokens later)."""
        ...
