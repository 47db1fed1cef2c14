"""What the engine and the offline API return: text and tokens per request."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from tidal.core import PromptLogprob, TokenLogprob


@dataclass
class StepUpdate:
    """What one engine step produced for one sequence."""

    request_id: str  # the sequence's id (an n>1 sibling has its own, `id-k`)
    root_id: str  # the id the caller submitted
    index: int  # which of the n sequences
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None = None
    finish_message: str | None = None
    logprobs: list[TokenLogprob] | None = None  # one per new token, where asked for
    # Index 0 only, with its first token: one per prompt position, None for position 0,
    # which has no context.
    prompt_logprobs: list[PromptLogprob | None] | None = None
    embedding: list[float] | None = None  # SamplingParams.embed: with the first token
    stop_string: str | None = None  # with finish_reason "stop": the stop string met, if one
    events: list | None = None  # SamplingParams.trace: the scheduler's events (request_events)
    cached_tokens: int = 0  # its prompt's tokens the prefix cache held (RequestOutput's)
    queue_seconds: float = 0.0  # from its arrival to its first admission (RequestOutput's)

    def then(self, later: "StepUpdate") -> "StepUpdate":
        """This update and the same sequence's next one as one: their tokens, text, logprobs
        and events in order, the later one's ending."""
        return replace(
            later, new_token_ids=self.new_token_ids + later.new_token_ids,
            new_text=self.new_text + later.new_text,
            logprobs=None if self.logprobs is None and later.logprobs is None
            else (self.logprobs or []) + (later.logprobs or []),
            prompt_logprobs=self.prompt_logprobs or later.prompt_logprobs,
            embedding=self.embedding or later.embedding,
            events=None if self.events is None and later.events is None
            else (self.events or []) + (later.events or []),
            cached_tokens=self.cached_tokens, queue_seconds=self.queue_seconds)


@dataclass
class CompletionOutput:
    """One generated sequence."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] | None = None


@dataclass
class GenerationOutput:
    """A prompt and its n completions."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    prompt_logprobs: list[PromptLogprob | None] | None = None
    """With SamplingParams.prompt_logprobs: one entry per prompt token, None for the first
    (nothing before it predicts it)."""
    embedding: list[float] | None = None
    """With SamplingParams.embed: the prompt's pooled embedding."""
    num_cached_tokens: int = 0
    """The prompt's tokens found in the prefix cache (or a tier below it) when it was first
    admitted: not computed for it."""

    @property
    def finished(self) -> bool:
        return all(o.finish_reason is not None for o in self.outputs)


@dataclass
class BeamSequence:
    """One answer of a beam search: its text, its tokens (a final stop token included),
    the sum of their logprobs, and why it ended (`stop` or `length`)."""

    text: str
    token_ids: list[int]
    cum_logprob: float
    finish_reason: str | None


@dataclass
class BeamSearchOutput:
    """A prompt and its beam search's answers, best first (`LLM.beam_search`)."""

    prompt: str | None
    prompt_token_ids: list[int]
    sequences: list[BeamSequence]
