"""Speculative decoding's proposers: each guesses the tokens that follow a sequence, for the
model to verify in one forward pass (tidal/core/speculation.py plans how many)."""

from tidal.spec.ngram import NgramProposer
from tidal.spec.proposer import Proposer
from tidal.spec.suffix import SuffixProposer

METHODS = ("ngram", "suffix")

__all__ = ["METHODS", "NgramProposer", "Proposer", "SuffixProposer"]
