"""OpenAI response bodies as typed msgspec structs, encoded straight to JSON: the final
bodies of chat and completions, their streamed chunks, and the pieces they share.

Fields that OpenAI leaves out when they are empty (a message's `tool_calls`, a delta's
parts) default to a value `omit_defaults` drops; fields OpenAI always sends (`logprobs`,
`finish_reason`, a message's `content`) have no default and are sent as null."""

from __future__ import annotations

import msgspec
from msgspec import UNSET, Struct, UnsetType

from tidal import __version__

_encoder = msgspec.json.Encoder()
# OpenAI's system_fingerprint names the backend configuration; here, tidal's version
FINGERPRINT = f"tidal-{__version__}"


def encode(obj) -> bytes:
    """JSON bytes of a response struct (or any msgspec-encodable value)."""
    return _encoder.encode(obj)


def sse(obj) -> str:
    """One server-sent event carrying `obj` as JSON."""
    return f"data: {_encoder.encode(obj).decode()}\n\n"


class PromptTokensDetails(Struct):
    cached_tokens: int  # prompt tokens read from the prefix cache, not computed


class CompletionTokensDetails(Struct):
    reasoning_tokens: int  # output tokens inside a <think> block (--reasoning-parser)


class Usage(Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails
    completion_tokens_details: CompletionTokensDetails | UnsetType = UNSET  # chat, reasoning


# ------------------------------------------------------------------ tool calls

class FunctionCall(Struct):
    name: str
    arguments: str  # JSON text, as the model wrote it


class ToolCall(Struct):
    id: str
    function: FunctionCall
    type: str = "function"


class FunctionDelta(Struct, omit_defaults=True):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(Struct, omit_defaults=True):
    """A streamed piece of one call: its first piece has id, type and name."""

    index: int
    id: str | None = None
    type: str | None = None
    function: FunctionDelta | None = None


# ------------------------------------------------------------------ chat

class TopLogprob(Struct):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(Struct):
    """OpenAI's entry of a chat choice's logprobs (the wire form of a core TokenLogprob)."""

    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprob]


class ChatLogprobs(Struct):
    content: list[ChatTokenLogprob]


class AssistantMessage(Struct, omit_defaults=True):
    role: str
    content: str | None
    refusal: str | None  # OpenAI's, always sent: tidal never refuses (null)
    tool_calls: list[ToolCall] = []
    reasoning_content: str | None = None  # with --reasoning-parser


class ChatChoice(Struct):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: str | None
    token_ids: list[int] | UnsetType = UNSET  # vLLM's return_token_ids


class RankedLogprob(Struct):
    """vLLM's entry of prompt_logprobs (the wire form of a core PromptLogprob): a token's
    logprob, its rank (1: the likeliest) and its text."""

    logprob: float
    rank: int
    decoded_token: str


# vLLM's prompt_logprobs: per prompt token, {token id: entry} for the token itself and the
# top alternatives; None for the first token, which has no context.
PromptLogprobs = list[dict[str, RankedLogprob] | None]


class ChatCompletion(Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    object: str = "chat.completion"
    system_fingerprint: str = FINGERPRINT
    prompt_logprobs: PromptLogprobs | UnsetType = UNSET  # sent only when asked for
    prompt_token_ids: list[int] | UnsetType = UNSET  # vLLM's return_token_ids


class Delta(Struct, omit_defaults=True):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallDelta] = []


class ChatChunkChoice(Struct):
    index: int
    delta: Delta
    logprobs: ChatLogprobs | None
    finish_reason: str | None
    token_ids: list[int] | UnsetType = UNSET  # vLLM's return_token_ids: the chunk's tokens


# ------------------------------------------------------------------ completions

class CompletionLogprobs(Struct):
    tokens: list[str]
    token_logprobs: list[float | None]  # None for a prompt's first token (echo)
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(Struct):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None
    prompt_logprobs: PromptLogprobs | UnsetType = UNSET  # sent only when asked for
    # vLLM's return_token_ids: the prompt's (streamed: in a choice's first chunk) and the
    # output's (streamed: the chunk's)
    prompt_token_ids: list[int] | UnsetType = UNSET
    token_ids: list[int] | UnsetType = UNSET


# ------------------------------------------------------------------ envelopes

class Completion(Struct):
    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage
    object: str = "text_completion"
    system_fingerprint: str = FINGERPRINT


class Chunk(Struct, omit_defaults=True):
    """A streamed chunk of either endpoint; `usage` is sent (null until the last chunk)
    only when the client asked for it with stream_options.include_usage."""

    id: str
    object: str
    created: int
    model: str
    system_fingerprint: str  # no default: omit_defaults would drop it
    choices: list  # ChatChunkChoice or CompletionChoice
    usage: Usage | None | UnsetType = UNSET
    prompt_token_ids: list[int] | UnsetType = UNSET  # a chat's first, with return_token_ids
