"""OpenAI request bodies (pydantic) and their translation into SamplingParams, with the
checks that turn bad input into HTTP 400 before anything reaches the engine core.

Nothing is silently ignored. Every field a body may hold is one of:
- honoured: a declared field that changes what tidal does;
- harmless: a declared field tidal accepts and does not use, because it cannot change the
  output (`user`, `metadata`, `store`, the prompt-cache hints, ...; docs/serving.md says why
  for each);
- refused: listed in a model's `_refused` table (refusals.py: OpenAI fields and vLLM
  extensions tidal does not implement yet); a value that asks for nothing (null, or what
  tidal does anyway, such as `response_format: {"type": "text"}`) passes, any other is a 400
  naming the field;
- anything else is a 400 "Unrecognized request argument supplied", as OpenAI answers.
A null value means the field is absent, as in OpenAI's API."""

from __future__ import annotations

import json
from typing import Any, ClassVar, Literal

from jinja2 import TemplateError
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, model_validator
from pydantic_core import PydanticCustomError

from tidal.core import SamplingParams
from tidal.server.refusals import (CHAT_REFUSED, COMPLETION_REFUSED, NOT_YET, TOOLS,
                                     VLLM_REFUSED)
from tidal.server.structured import ConstraintError, structured_spec


class APIError(Exception):
    """Becomes an OpenAI-style error body with this HTTP status (a 429 also says when to
    retry, in seconds, as a Retry-After header)."""

    def __init__(self, message: str, status: int = 400, kind: str = "invalid_request_error",
                 param: str | None = None, retry_after: int | None = None) -> None:
        super().__init__(message)
        self.message, self.status, self.kind, self.param = message, status, kind, param
        self.retry_after = retry_after if retry_after is not None else (
            1 if status == 429 else None)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": self.status}}


def check_token_ids(ids, vocab_size: int, param: str) -> None:
    """A 400 naming `param` unless every id is a token of the vocabulary."""
    if any(not 0 <= t < vocab_size for t in ids):
        raise APIError(f"{param}: token ids must be in [0, {vocab_size})", param=param)


def refuse(param: str, message: str) -> PydanticCustomError:
    """A validation error the error handler turns into a 400 naming `param` (appended to
    where the failing model sits in the body, e.g. messages.2)."""
    return PydanticCustomError("refused", message, {"param": param})


def _passes(value: Any, allowed: tuple) -> bool:
    """Whether `value` is one of `allowed`, types included (False is not 0)."""
    return any(type(value) is type(a) and value == a for a in allowed)


class StrictModel(BaseModel):
    """Refuses unknown fields, and the `_refused` table's fields unless their value passes;
    null counts as absent. Refused fields that pass are dropped: they ask for nothing."""

    model_config = ConfigDict(extra="forbid")
    _refused: ClassVar[dict[str, tuple[tuple, str]]] = {}

    @model_validator(mode="before")
    @classmethod
    def _screen(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data  # pydantic says what is wrong with it
        out = {}  # a copy: the P/D router forwards the body as the client sent it
        for key, value in data.items():
            if value is None:
                continue
            if key in cls._refused:
                allowed, why = cls._refused[key]
                if not _passes(value, allowed):
                    accepted = "null" + "".join(f", {json.dumps(a)}" for a in allowed)
                    raise refuse(key, f"{key} is not supported: {why} (accepted: {accepted})")
            elif key not in cls.model_fields:
                raise refuse(key, f"Unrecognized request argument supplied: {key}")
            else:
                out[key] = value
        return out


class StreamOptions(StrictModel):
    """stream_options: a last chunk with the usage when include_usage."""

    include_usage: bool = False
    include_obfuscation: bool = True  # harmless: tidal adds no obfuscation padding to chunks


def _part_text(i: int, part: Any) -> str:
    """A content part's text; any other kind of part is refused."""
    where = f"content.{i}"
    if not isinstance(part, dict):
        raise refuse(where, "a content part must be an object with a 'type'")
    kind = part.get("type")
    if kind != "text":
        raise refuse(f"{where}.type", f"content parts of type {kind!r} are not supported: "
                                      "this server takes text parts only")
    for key in part:
        if key not in ("type", "text", "prompt_cache_breakpoint"):  # the last is a cache hint
            raise refuse(f"{where}.{key}", f"Unrecognized request argument supplied: {key}")
    if not isinstance(part.get("text"), str):
        raise refuse(f"{where}.text", "a text part needs a string 'text'")
    return part["text"]


class ChatMessage(StrictModel):
    """One message of a conversation; content is text or a list of text parts, joined with
    newlines (as vLLM does). `name` goes to the chat template."""

    _refused: ClassVar = {
        "tool_calls": (([],), TOOLS),
        "function_call": ((), TOOLS),
        "tool_call_id": ((), TOOLS),
        "audio": ((), "tidal serves text-only models"),
        "refusal": ((), NOT_YET),
    }

    role: Literal["system", "developer", "user", "assistant"]
    content: str | None = None
    name: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _content(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        role = data.get("role")
        if role in ("tool", "function"):
            raise refuse("role", f"{role!r} messages are not supported: {TOOLS}")
        content = data.get("content")
        if isinstance(content, list):
            data = {**data, "content": "\n".join(_part_text(i, p) for i, p in enumerate(content))}
        return data

    def template_dict(self) -> dict:
        """The message as the chat template sees it (developer messages as system ones)."""
        out = {"role": "system" if self.role == "developer" else self.role,
               "content": self.content or ""}
        if self.name is not None:
            out["name"] = self.name
        return out


def chat_prompt_ids(messages: list[ChatMessage], tokenizer, add_generation_prompt: bool,
                    add_special_tokens: bool) -> list[int]:
    """A conversation through the model's chat template, as token ids."""
    if not messages:
        raise APIError("messages must not be empty", param="messages")
    dicts = [m.template_dict() for m in messages]
    if all(not m["content"] for m in dicts):
        raise APIError("the messages hold no text", param="messages")
    try:
        text = tokenizer.apply_chat_template(dicts, add_generation_prompt=add_generation_prompt)
    except (ValueError, TemplateError) as exc:  # the template refused the conversation
        raise APIError(f"the chat template refused the messages: {exc}",
                       param="messages") from exc
    return encode(tokenizer, text, add_special_tokens, "messages")


def is_unicode(text: str) -> bool:
    """False for a lone surrogate ("\\ud800" in JSON), which the tokenizer and msgspec refuse."""
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


def encode(tokenizer, text: str, add_special_tokens: bool, param: str) -> list[int]:
    """Token ids of `text`; a 400 naming `param` for text that is not valid Unicode."""
    if not is_unicode(text):
        raise APIError(f"{param}: the text is not valid Unicode (a lone surrogate)",
                       param=param)
    return tokenizer.encode(text, add_special_tokens=add_special_tokens)


_INT64_MAX = 2**63 - 1  # integers travel to the engine core as msgpack int64


class GenerationRequest(StrictModel):
    """Fields both endpoints share; vLLM's extensions (ignore_eos, priority, min_tokens,
    top_k, min_p, repetition_penalty, stop_token_ids, add_special_tokens,
    kv_transfer_params) included, and tidal's latency targets (ttft_slo_ms, tpot_slo_ms:
    the `slo` policy's)."""

    _refused: ClassVar = VLLM_REFUSED
    prompt_field: ClassVar[str] = "prompt"  # what a 400 for a prompt over the context names

    model: str | None = None
    max_tokens: int | None = None
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=-1, le=_INT64_MAX)
    min_p: float = Field(0.0, ge=0, le=1)
    seed: int | None = Field(None, ge=-_INT64_MAX - 1, le=_INT64_MAX)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None  # each checked against the vocabulary
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    repetition_penalty: float = Field(1.0, gt=0, le=10)
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> bias
    n: int = Field(1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    priority: int = Field(0, ge=-_INT64_MAX - 1, le=_INT64_MAX)
    min_tokens: int = Field(0, ge=0)
    user: str | None = None  # harmless: an end-user id for abuse monitoring
    kv_transfer_params: dict | None = None  # P/D: {"prefill_address": ...}, set by the router
    ttft_slo_ms: float | None = Field(None, gt=0, le=1e9)  # only with --policy slo
    tpot_slo_ms: float | None = Field(None, gt=0, le=1e9)
    # Output constraints (server/structured.py): OpenAI's, and vLLM's extensions.
    response_format: dict | None = None
    structured_outputs: dict | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    _constraint: tuple[str, tuple[str, str]] | None = PrivateAttr(None)

    @model_validator(mode="after")
    def _one_constraint(self) -> "GenerationRequest":
        try:
            self._constraint = structured_spec(self)
        except ConstraintError as exc:
            raise refuse(exc.param, str(exc)) from None
        return self

    def output_constraint(self) -> tuple[str, tuple[str, str]] | None:
        """(the field that asked for it, (kind, spec)) of the output constraint, or None."""
        return self._constraint

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> "GenerationRequest":
        if self.stream_options is not None and not self.stream:
            raise refuse("stream_options", "stream_options is only allowed with stream=true")
        return self

    @model_validator(mode="after")
    def _prefill_address_is_text(self) -> "GenerationRequest":
        address = (self.kv_transfer_params or {}).get("prefill_address")
        if address is not None and not (isinstance(address, str) and is_unicode(address)):
            raise refuse("kv_transfer_params.prefill_address",
                         "kv_transfer_params.prefill_address must be a string of valid "
                         "Unicode")
        return self

    def limit_field(self) -> str:
        """The field that set the output limit, for the 400s about it."""
        return "max_tokens"

    def sampling_params(self, max_tokens: int | None, logprobs: int | None, limits,
                        prompt_len: int, max_model_len: int, default_max: int | None,
                        vocab_size: int) -> SamplingParams:
        """The engine's parameters for one prompt; `limits` is the server's ServerConfig
        (max_n, max_total_tokens, max_stop_strings, max_stop_length)."""
        if self.n > limits.max_n:
            raise APIError(f"n must be at most {limits.max_n}, got {self.n}", param="n")
        room = max_model_len - prompt_len
        if room < 1:
            raise APIError(f"the prompt has {prompt_len} tokens; this model's context is "
                           f"{max_model_len} tokens", param=self.prompt_field)
        field, cap = self.limit_field(), limits.max_total_tokens
        if max_tokens is None:
            max_tokens = room if default_max is None else min(default_max, room)
            if cap is not None:  # a default fits the cap rather than being refused
                max_tokens, field = max(1, min(max_tokens, cap // self.n)), "n"
        if max_tokens < 1:
            raise APIError(f"{field} must be at least 1, got {max_tokens}", param=field)
        if max_tokens > room:
            raise APIError(f"{field} ({max_tokens}) plus the prompt ({prompt_len} tokens) "
                           f"exceeds this model's context of {max_model_len} tokens",
                           param=field)
        if cap is not None and self.n * max_tokens > cap:
            raise APIError(f"n ({self.n}) x {self.limit_field()} ({max_tokens}) is over this "
                           f"server's limit of {cap} output tokens per prompt", param=field)
        check_token_ids(self.stop_token_ids or [], vocab_size, "stop_token_ids")
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stop) > limits.max_stop_strings:
            raise APIError(f"stop takes at most {limits.max_stop_strings} strings, got "
                           f"{len(stop)}", param="stop")
        if any(len(s) > limits.max_stop_length for s in stop):  # a stream holds that back
            raise APIError(f"a stop string may be at most {limits.max_stop_length} "
                           "characters long", param="stop")
        if not all(map(is_unicode, stop)):  # it travels to the engine core as UTF-8
            raise APIError("stop: the text is not valid Unicode (a lone surrogate)",
                           param="stop")
        try:
            return SamplingParams(
                max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p,
                top_k=self.top_k, min_p=self.min_p, seed=self.seed, n=self.n,
                stop_token_ids=list(self.stop_token_ids or []), ignore_eos=self.ignore_eos,
                stop=stop, priority=self.priority, presence_penalty=self.presence_penalty,
                frequency_penalty=self.frequency_penalty,
                repetition_penalty=self.repetition_penalty, logprobs=logprobs,
                min_tokens=self.min_tokens, logit_bias=self.token_bias(vocab_size),
                structured=self._constraint and self._constraint[1],
                ttft_slo_ms=self.ttft_slo_ms,
                tpot_slo_ms=self.tpot_slo_ms)
        except ValueError as exc:  # its messages start with the field's name
            word = str(exc).split(" ", 1)[0]
            param = word if word in type(self).model_fields else None
            raise APIError(str(exc), param=param) from exc

    def token_bias(self, vocab_size: int) -> dict[int, float]:
        """logit_bias with int keys, each a token of the vocabulary and in [-100, 100]."""
        bias = {}
        for key, value in (self.logit_bias or {}).items():
            if not key.removeprefix("-").isdecimal():
                raise APIError(f"logit_bias keys must be token ids, got {key!r}",
                               param="logit_bias")
            token = int(key)
            if not 0 <= token < vocab_size:
                raise APIError(f"logit_bias token id {token} is not in the vocabulary "
                               f"[0, {vocab_size})", param="logit_bias")
            if not -100 <= value <= 100:
                raise APIError(f"logit_bias values must be in [-100, 100], got {value} for "
                               f"token {token}", param="logit_bias")
            bias[token] = value
        return bias

    def check_disaggregated(self) -> None:
        """Refuse what prefill/decode disaggregation cannot serve (the server and the P/D
        router say it in the same words)."""
        if self.n > 1:
            raise APIError("n > 1 is not supported with prefill/decode disaggregation",
                           param="n")


class CompletionRequest(GenerationRequest):
    """A /v1/completions body."""

    _refused: ClassVar = {**VLLM_REFUSED, **COMPLETION_REFUSED}

    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=20)
    best_of: int | None = Field(None, ge=1)  # only equal to n: the best n of n are all n
    add_special_tokens: bool = True  # vLLM: the tokenizer's BOS and the like for strings

    @model_validator(mode="after")
    def _best_of(self) -> "CompletionRequest":
        if self.best_of is not None and self.best_of < self.n:
            raise refuse("best_of", f"best_of ({self.best_of}) must be at least n ({self.n})")
        if self.best_of is not None and self.best_of > self.n:
            raise refuse("best_of", f"best_of > n is not supported: tidal does not rank "
                                    f"candidates (accepted: null or n, {self.n})")
        return self

    def prompt_ids(self, tokenizer) -> list[list[int]]:
        """One token-id list per prompt: strings are tokenized, ids pass as they are."""
        p, special = self.prompt, self.add_special_tokens
        if isinstance(p, str):  # the empty one is refused on submit
            return [encode(tokenizer, p, special, "prompt")] if p else [[]]
        if p and all(isinstance(x, str) for x in p):
            return [encode(tokenizer, x, special, "prompt") for x in p]
        if p and all(isinstance(x, int) for x in p):
            return [list(p)]
        if p and all(isinstance(x, list) for x in p):
            return [list(x) for x in p]
        raise APIError("the prompt is empty", param="prompt")


class ChatRequest(GenerationRequest):
    """A /v1/chat/completions body."""

    _refused: ClassVar = {**VLLM_REFUSED, **CHAT_REFUSED}
    prompt_field: ClassVar[str] = "messages"

    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    add_generation_prompt: bool = True  # vLLM: end the prompt where the assistant answers
    add_special_tokens: bool = False  # vLLM: the chat template writes them already
    # Harmless (docs/serving.md): they concern OpenAI's storage and caching, not the output.
    metadata: dict[str, str] | None = None
    store: bool | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    prompt_cache_options: dict | None = None
    safety_identifier: str | None = None

    def prompt_ids(self, tokenizer) -> list[list[int]]:
        """The conversation through the chat template, as the one prompt's token ids."""
        return [chat_prompt_ids(self.messages, tokenizer, self.add_generation_prompt,
                                self.add_special_tokens)]

    def num_logprobs(self) -> int | None:
        """Alternatives per token to report (0: the chosen token's only), None for none."""
        if self.top_logprobs and not self.logprobs:
            raise APIError("top_logprobs needs logprobs=true", param="top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None

    def output_limit(self) -> int | None:
        """max_completion_tokens, or the older max_tokens."""
        return (self.max_completion_tokens if self.max_completion_tokens is not None
                else self.max_tokens)

    def limit_field(self) -> str:
        return "max_tokens" if self.max_completion_tokens is None else "max_completion_tokens"


class TokenizeRequest(StrictModel):
    """POST /tokenize, either of vLLM's shapes: {prompt} or {messages}."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True  # messages only
    add_special_tokens: bool | None = None  # vLLM's default: true for a prompt, false for messages

    @model_validator(mode="after")
    def _one_input(self) -> "TokenizeRequest":
        if (self.prompt is None) == (self.messages is None):
            raise refuse("prompt", "send either prompt or messages")
        return self

    def token_ids(self, tokenizer) -> list[int]:
        special = self.add_special_tokens
        if self.prompt is not None:
            return encode(tokenizer, self.prompt, special is not False, "prompt")
        return chat_prompt_ids(self.messages, tokenizer, self.add_generation_prompt,
                               bool(special))


class DetokenizeRequest(StrictModel):
    """POST /detokenize: token ids back to text."""

    model: str | None = None
    tokens: list[int]
