"""The guesser an engine's speculative config asks for: the one place that turns a method's
name into its implementation (add a method here and to `METHODS`)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from tidal.spec.guesser import Guesser
from tidal.spec.ngram import NgramProposer
from tidal.spec.speculator import Speculator
from tidal.spec.suffix import SuffixProposer

if TYPE_CHECKING:
    from tidal.engine.config import ModelConfig, SpeculativeConfig


def make_guesser(config: "SpeculativeConfig", max_guesses: int, target: Path,
                 model: "ModelConfig", device: str, ext) -> Guesser:
    """The guesser of `config.speculative_method` for a target model in folder `target`
    (a draft model loads on `device`, with the C++ extension `ext` where the target has
    it)."""
    method = config.speculative_method
    if method == "ngram":
        proposer = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max,
                                 config.speculative_branches)
    elif method == "suffix":
        proposer = SuffixProposer(config.suffix_max_depth, config.suffix_min_prob,
                                  cache_requests=config.suffix_cache_requests,
                                  branches=config.speculative_branches)
    elif method == "draft":
        from tidal.model.registry import resolve_model
        from tidal.spec.draft import DraftModel, check_same_tokenizer

        folder = resolve_model(config.speculative_model)[0]
        check_same_tokenizer(target, folder)
        return DraftModel(folder, model, device, ext, max_guesses)
    else:
        raise ValueError(f"no guesser for speculative_method={method!r}")
    return Speculator(proposer, max_guesses)
