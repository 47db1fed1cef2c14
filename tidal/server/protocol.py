"""OpenAI request bodies (pydantic) and their translation into SamplingParams, with the
checks that turn bad input into HTTP 400 before anything reaches the engine core."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from tidal.core import SamplingParams


class APIError(Exception):
    """Becomes an OpenAI-style error body with this HTTP status."""

    def __init__(self, message: str, status: int = 400, kind: str = "invalid_request_error",
                 param: str | None = None) -> None:
        super().__init__(message)
        self.message, self.status, self.kind, self.param = message, status, kind, param

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": self.status}}


class StreamOptions(BaseModel):
    """stream_options: a last chunk with the usage when include_usage."""

    include_usage: bool = False


class GenerationRequest(BaseModel):
    """Fields both endpoints share; vLLM's extensions (ignore_eos, priority, min_tokens,
    top_k, min_p, repetition_penalty, stop_token_ids) included."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = None
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=-1)
    min_p: float = Field(0.0, ge=0, le=1)
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    repetition_penalty: float = Field(1.0, gt=0, le=10)
    n: int = Field(1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    priority: int = 0
    min_tokens: int = Field(0, ge=0)
    user: str | None = None
    kv_transfer_params: dict | None = None  # P/D: {"prefill_address": ...}, set by the router

    def sampling_params(self, max_tokens: int | None, logprobs: int | None, max_n: int,
                        prompt_len: int, max_model_len: int, default_max: int | None
                        ) -> SamplingParams:
        if self.n > max_n:
            raise APIError(f"n must be at most {max_n}, got {self.n}", param="n")
        room = max_model_len - prompt_len
        if room < 1:
            raise APIError(f"the prompt has {prompt_len} tokens; this model's context is "
                           f"{max_model_len} tokens")
        if max_tokens is None:
            max_tokens = room if default_max is None else min(default_max, room)
        if max_tokens < 1:
            raise APIError(f"max_tokens must be at least 1, got {max_tokens}",
                           param="max_tokens")
        if max_tokens > room:
            raise APIError(f"max_tokens ({max_tokens}) plus the prompt ({prompt_len} tokens) "
                           f"exceeds this model's context of {max_model_len} tokens",
                           param="max_tokens")
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stop) > 16:  # SamplingParams checks the strings themselves
            raise APIError("stop takes at most 16 strings", param="stop")
        try:
            return SamplingParams(
                max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p,
                top_k=self.top_k, min_p=self.min_p, seed=self.seed, n=self.n,
                stop_token_ids=list(self.stop_token_ids or []), ignore_eos=self.ignore_eos,
                stop=stop, priority=self.priority, presence_penalty=self.presence_penalty,
                frequency_penalty=self.frequency_penalty,
                repetition_penalty=self.repetition_penalty, logprobs=logprobs,
                min_tokens=self.min_tokens)
        except ValueError as exc:
            raise APIError(str(exc)) from exc

    def check_disaggregated(self) -> None:
        """Refuse what prefill/decode disaggregation cannot serve (the server and the P/D
        router say it in the same words)."""
        if self.n > 1:
            raise APIError("n > 1 is not supported with prefill/decode disaggregation",
                           param="n")


class CompletionRequest(GenerationRequest):
    """A /v1/completions body."""

    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False

    def prompt_ids(self, tokenizer) -> list[list[int]]:
        """One token-id list per prompt: strings are tokenized, ids pass as they are."""
        if self.echo:
            raise APIError("echo is not supported", param="echo")
        p = self.prompt
        if isinstance(p, str):
            return [tokenizer.encode(p)] if p else [[]]  # the empty one is refused on submit
        if p and all(isinstance(x, str) for x in p):
            return [tokenizer.encode(x) for x in p]
        if p and all(isinstance(x, int) for x in p):
            return [list(p)]
        if p and all(isinstance(x, list) for x in p):
            return [list(x) for x in p]
        raise APIError("the prompt is empty", param="prompt")


class ChatMessage(BaseModel):
    """One message of a conversation; content is text or a list of text parts."""

    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[dict] | None = None

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for part in self.content:  # only text parts: this server has no vision models
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise APIError("only text content parts are supported", param="messages")
            parts.append(part["text"])
        return "".join(parts)


class ChatRequest(GenerationRequest):
    """A /v1/chat/completions body."""

    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)

    def prompt_ids(self, tokenizer) -> list[list[int]]:
        """The conversation through the chat template, as the one prompt's token ids."""
        if not self.messages:
            raise APIError("messages must not be empty", param="messages")
        messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()}
                    for m in self.messages]
        if all(not m["content"] for m in messages):
            raise APIError("the messages hold no text", param="messages")
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        return [tokenizer.encode(text, add_special_tokens=False)]

    def num_logprobs(self) -> int | None:
        """Alternatives per token to report (0: the chosen token's only), None for none."""
        if self.top_logprobs and not self.logprobs:
            raise APIError("top_logprobs needs logprobs=true", param="top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None

    def output_limit(self) -> int | None:
        """max_completion_tokens, or the older max_tokens."""
        return (self.max_completion_tokens if self.max_completion_tokens is not None
                else self.max_tokens)
