"""Speculative decoding's guessers: proposers (ngram, suffix) and a draft model, each
guessing the tokens that follow a sequence for the model to verify in one forward pass
(tidal/core/speculation.py plans how many; docs/design/speculative.md).

- `proposer.py`, `ngram.py`, `suffix.py`: proposers, which guess from token histories;
- `speculator.py`: a proposer as the runner's `Guesser`;
- `draft.py`: a draft model as one;
- `tree.py`: guesses as a tree of candidate continuations, and the verification rule;
- `guesser.py`: the runner's interface to them; `factory.py`: method -> guesser.
"""

from tidal.spec.guesser import Guesser
from tidal.spec.ngram import NgramProposer
from tidal.spec.proposer import Proposer
from tidal.spec.suffix import SuffixProposer
from tidal.spec.tree import GuessTree

METHODS = ("ngram", "suffix", "draft")  # speculative_method's choices

__all__ = ["METHODS", "GuessTree", "Guesser", "NgramProposer", "Proposer", "SuffixProposer"]
