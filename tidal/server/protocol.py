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
    include_usage: bool = False


class _Sampling(BaseModel):
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


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False


class ChatMessage(BaseModel):
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


class ChatRequest(_Sampling):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
