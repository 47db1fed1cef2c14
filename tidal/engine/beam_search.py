"""Beam search (vLLM's `use_beam_search`, `LLM.beam_search`): the bookkeeping of one
prompt's beams, apart from who runs the model. Each step extends every live beam by its
likeliest next tokens (a one-token request per beam, asking for their logprobs: the prefix
cache holds the blocks the beams share), keeps the `width` best that go on, and sets aside
those that chose a stop token. A beam's score is its summed logprob divided by its length
(output tokens, a final stop token included) to the power `length_penalty`, as
transformers ranks them (vLLM counts the prompt's tokens in the length too, which makes a
long prompt's penalty all but vanish); the `width` best finished beams are the answer.

The search ends once no live beam can still reach the worst of the `width` best finished
ones (a logprob is never positive, so a beam's sum only falls): the answer is the one a
search run to `max_tokens` would give, without its last steps."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from tidal.core import MASKED_LOGPROB, SamplingParams

Candidates = list[tuple[int, float]]  # a beam's likeliest next tokens and their logprobs


@dataclass
class Beam:
    """One hypothesis: its output tokens so far and the sum of their logprobs."""

    token_ids: list[int] = field(default_factory=list)
    cum_logprob: float = 0.0
    finish_reason: str | None = None  # "stop" (it chose a stop token) or "length"

    def text_ids(self, keep_stop: bool) -> list[int]:
        """The tokens its text decodes: a final stop token only if `keep_stop`."""
        if self.finish_reason == "stop" and not keep_stop:
            return self.token_ids[:-1]
        return self.token_ids


@dataclass
class BeamSearchParams:
    """The offline `LLM.beam_search`'s parameters, as vLLM's."""

    beam_width: int
    """How many beams go on each step, and how many answers come back."""
    max_tokens: int
    """Most output tokens of a beam (finish reason `length`)."""
    ignore_eos: bool = False
    """The EOS token does not end a beam (stop_token_ids still do)."""
    length_penalty: float = 1.0
    """A beam's score divides its summed logprob by its length to this power: above 0
    longer answers gain, below 0 shorter ones."""
    include_stop_str_in_output: bool = False
    """Keep the stop token's text in a beam's text."""
    stop_token_ids: list[int] = field(default_factory=list)
    """Tokens that end a beam besides EOS."""

    def __post_init__(self) -> None:
        if self.beam_width < 1 or self.max_tokens < 1:
            raise ValueError("beam_width and max_tokens must be at least 1")
        if not math.isfinite(self.length_penalty):
            raise ValueError("length_penalty must be a finite number")


class BeamSearch:
    """One prompt's beams. `live` are the beams to extend next; `extend` takes each one's
    candidates (in `live`'s order); the search is over when `live` is empty, and `best()`
    is its answer."""

    def __init__(self, width: int, max_tokens: int, stop_token_ids: set[int],
                 length_penalty: float = 1.0) -> None:
        self.width, self.max_tokens = width, max_tokens
        self.stop_token_ids, self.length_penalty = stop_token_ids, length_penalty
        self.live: list[Beam] = [Beam()]
        self.finished: list[Beam] = []  # the `width` best so far, best first

    @property
    def num_candidates(self) -> int:
        """How many next tokens to ask of each beam: enough that `width` of them go on even
        when every stop token is among them."""
        return 2 * self.width + len(self.stop_token_ids)

    def score(self, beam: Beam) -> float:
        return beam.cum_logprob / len(beam.token_ids) ** self.length_penalty

    def extend(self, candidates: list[Candidates]) -> None:
        """One step: every live beam grown by each of its candidates (masked tokens, at the
        sampler's floor, left out); the `width` likeliest go on."""
        if len(candidates) != len(self.live):
            raise ValueError(f"{len(candidates)} candidate lists for {len(self.live)} beams")
        grown, ended = [], []
        for beam, top in zip(self.live, candidates):
            for token, logprob in top:
                if logprob <= MASKED_LOGPROB:
                    continue
                child = Beam(beam.token_ids + [token], beam.cum_logprob + logprob)
                if token in self.stop_token_ids:
                    child.finish_reason = "stop"
                    ended.append(child)
                else:
                    grown.append(child)
        grown.sort(key=lambda b: b.cum_logprob, reverse=True)  # one length: the score's order
        self.live = grown[:self.width]
        if self.live and len(self.live[0].token_ids) >= self.max_tokens:
            ended += [replace(b, finish_reason="length") for b in self.live]
            self.live = []
        self.finished = sorted(self.finished + ended, key=self.score,
                               reverse=True)[:self.width]
        if self.live and len(self.finished) == self.width and \
                self._reach(self.live[0]) < self.score(self.finished[-1]):
            self.live = []  # no beam that goes on can enter the answer

    def _reach(self, beam: Beam) -> float:
        """The best score `beam`'s descendants can have: its sum, which only falls, over
        the length that divides it most (the longest with a positive penalty, the shortest
        with a negative one)."""
        length = self.max_tokens if self.length_penalty > 0 else len(beam.token_ids) + 1
        return beam.cum_logprob / length ** self.length_penalty

    def best(self) -> list[Beam]:
        """The answer, best first (once `live` is empty)."""
        return list(self.finished)


class BeamSearches:
    """One request's searches, a prompt each, stepped together: `asks()` are the step's
    one-token prompts (every live beam of every search, each after its prompt), `extend`
    takes their candidates in that order."""

    def __init__(self, prompts: list[list[int]], searches: list[BeamSearch]) -> None:
        self.prompts, self.searches = prompts, searches
        self.owners: list[int] = []  # the search of each ask of the step

    @property
    def live(self) -> bool:
        return any(s.live for s in self.searches)

    def asks(self) -> list[list[int]]:
        self.owners = [k for k, s in enumerate(self.searches) for _ in s.live]
        return [self.prompts[k] + b.token_ids for k, s in enumerate(self.searches)
                for b in s.live]

    def extend(self, candidates: list[Candidates]) -> None:
        for k, s in enumerate(self.searches):
            if s.live:
                s.extend([c for c, o in zip(candidates, self.owners) if o == k])


def step_params(base: SamplingParams, search: BeamSearch) -> SamplingParams:
    """A beam's one-token request: `base`'s distribution (logit_bias, allowed_token_ids,
    its adapter and salt), greedy, with the candidates' logprobs of that distribution
    whatever the engine's logprobs_mode; nothing ends it early."""
    return replace(base, n=1, max_tokens=1, min_tokens=0, temperature=0.0, top_p=1.0,
                   top_k=0, min_p=0.0, seed=None, stop=[], stop_token_ids=[],
                   ignore_eos=True, logprobs=search.num_candidates, prompt_logprobs=None,
                   include_stop_str_in_output=False, logprobs_mode="adjusted_logprobs")


def stop_token_ids(stop_ids: list[int], end_tokens: tuple[int, ...], ignore_eos: bool,
                   ) -> set[int]:
    """The tokens that end a beam: stop_token_ids, and the model's end tokens (EOS, end of
    turn) unless ignored."""
    return set(stop_ids) | (set() if ignore_eos else set(end_tokens))
