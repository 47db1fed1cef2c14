"""The model runner's side of speculative decoding: the proposer, the guesses it holds for
each sequence, and verification of the model's samples against them."""

from __future__ import annotations

from tidal.engine.config import SpeculativeConfig
from tidal.spec import NgramProposer, Proposer, SuffixProposer


def make_proposer(config: SpeculativeConfig) -> Proposer:
    if config.speculative_method == "ngram":
        return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
    if config.speculative_method == "suffix":
        return SuffixProposer(config.suffix_max_depth, config.suffix_min_prob,
                              cache_requests=config.suffix_cache_requests)
    raise ValueError(f"no proposer for speculative_method={config.speculative_method!r}")


def accepted_run(guesses: list[int], samples: list[int]) -> list[int]:
    """The tokens a verification emits: sample j was drawn from the model's distribution
    after the guesses before it, so it stands while every earlier guess matched its sample;
    the first sample that differs from its guess is the last token (and with all guesses
    matched, the sample after them is a bonus token).

    For a proposer whose guess is one token, not a distribution, this is the rejection
    sampler of Leviathan et al. exactly: guess g is kept with probability p(g), and a
    rejected position emits a sample of p with g removed, renormalised; greedy rows keep
    g iff it is the argmax."""
    out = []
    for j, token in enumerate(samples):
        out.append(token)
        if j == len(guesses) or token != guesses[j]:
            break
    return out


class Speculator:
    """Guesses for the sequences the runner holds: proposed after each sample (the count
    goes to the scheduler, which plans k from it), handed out at the next step (proposed
    afresh if the sequence grew since)."""

    def __init__(self, config: SpeculativeConfig, max_guesses: int) -> None:
        self.proposer = make_proposer(config)
        self.max_guesses = max_guesses
        self._held: dict[str, tuple[int, list[int]]] = {}  # id -> (output length, guesses)

    def forget(self, seq_id: str, output: list[int], finished: bool) -> None:
        self._held.pop(seq_id, None)
        self.proposer.forget(seq_id, output, finished)

    def propose(self, seq_id: str, prompt: list[int], output: list[int]) -> int:
        """Guess ahead of `output` for the sequence's next step; returns how many."""
        guesses = self.proposer.propose(seq_id, prompt, output, self.max_guesses)
        self._held[seq_id] = (len(output), guesses)
        return len(guesses)

    def guesses(self, seq_id: str, prompt: list[int], output: list[int], k: int) -> list[int]:
        """Up to k guesses to verify after `output` now."""
        held = self._held.get(seq_id)
        if held is None or held[0] != len(output):  # grown since: async, or none asked for
            self.propose(seq_id, prompt, output)
            held = self._held[seq_id]
        return held[1][:k]
