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
from collections.abc import Mapping
from typing import TYPE_CHECKING, Annotated, Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, model_validator
from pydantic_core import PydanticCustomError

from tidal.core import SamplingParams
from tidal.server.openai.refusals import BEAM_SEARCH_REFUSED, COMPLETION_REFUSED, VLLM_REFUSED
from tidal.server.openai.structured import ConstraintError, structured_spec

if TYPE_CHECKING:
    from tidal.server.config import ServerConfig


# OpenAI's error codes are strings (or null): those of the statuses that have one
_CODES = {401: "invalid_api_key", 413: "request_too_large", 429: "rate_limit_exceeded"}


class APIError(Exception):
    """Becomes an OpenAI-style error body with this HTTP status (a 429 also says when to
    retry, in seconds, as a Retry-After header); its `code` a string or None, by default
    the status's (`_CODES`)."""

    def __init__(self, message: str, status: int = 400, kind: str = "invalid_request_error",
                 param: str | None = None, retry_after: int | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.message, self.status, self.kind, self.param = message, status, kind, param
        self.code = code if code is not None else _CODES.get(status)
        self.retry_after = retry_after if retry_after is not None else (
            1 if status == 429 else None)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": self.code}}


def truncated(prompts: list[list[int]], keep: int | None,
              max_model_len: int) -> list[list[int]]:
    """vLLM's truncate_prompt_tokens: each prompt's last `keep` tokens (-1: the model's
    context's worth; None: the prompts as they are)."""
    if keep is None:
        return prompts
    if keep == 0 or keep > max_model_len:
        raise APIError(f"truncate_prompt_tokens must be -1 (the context) or in [1, "
                       f"{max_model_len}], this model's context; got {keep}",
                       param="truncate_prompt_tokens")
    keep = max_model_len if keep == -1 else keep
    return [p[-keep:] for p in prompts]


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
    null counts as absent. Refused fields that pass are dropped: they ask for nothing.
    Types are strict: "10" is no integer, true no token id."""

    model_config = ConfigDict(extra="forbid", strict=True)
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

    def sampling_given(self) -> dict[str, Any]:
        """The sampling fields (temperature, top_p, top_k) this body sets: a chat request
        made from it leaves the others to the model's defaults (GenerationRequest.
        with_defaults)."""
        return {k: getattr(self, k) for k in ("temperature", "top_p", "top_k")
                if k in self.model_fields_set}


class StreamOptions(StrictModel):
    """stream_options: a last chunk with the usage when include_usage (and the usage so
    far in every chunk with vLLM's continuous_usage_stats)."""

    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM: with include_usage, usage in every chunk
    include_obfuscation: bool = True  # harmless: tidal adds no obfuscation padding to chunks


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


def prompt_lists(value, tokenizer, add_special_tokens: bool, param: str) -> list[list[int]]:
    """One token-id list per prompt of a field that takes a string, strings, token ids or
    lists of them (none empty: the schema): strings are tokenized, ids pass as they are."""
    if isinstance(value, str):
        return [encode(tokenizer, value, add_special_tokens, param)]
    if isinstance(value[0], str):
        return [encode(tokenizer, x, add_special_tokens, param) for x in value]
    if isinstance(value[0], int):
        return [list(value)]
    return [list(x) for x in value]


_INT64_MAX = 2**63 - 1  # integers travel to the engine core as msgpack int64
# What the schema can say of a prompt and its token ids (the vocabulary's end it cannot:
# that is a 400 naming the field).
TokenId = Annotated[int, Field(ge=0)]
Text = Annotated[str, Field(min_length=1)]
TokenIds = Annotated[list[TokenId], Field(min_length=1)]


class GenerationRequest(StrictModel):
    """Fields both endpoints share; vLLM's extensions (ignore_eos, priority, min_tokens,
    top_k, min_p, repetition_penalty, stop_token_ids, add_special_tokens,
    kv_transfer_params) included, and tidal's latency targets (ttft_slo_ms, tpot_slo_ms:
    the `slo` policy's)."""

    _refused: ClassVar = VLLM_REFUSED
    prompt_field: ClassVar[str] = "prompt"  # what a 400 for a prompt over the context names
    default_max_tokens: ClassVar[int | None] = None  # None: what the context leaves
    logprobs_field: ClassVar[str] = "logprobs"  # what asks for alternatives per output token

    model: str | None = None
    # vLLM's: the answer's id is `cmpl-<request_id>` (chat: `chatcmpl-`)
    request_id: Annotated[str, Field(min_length=1, max_length=128)] | None = None
    max_tokens: int | None = None
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=-1, le=_INT64_MAX)
    min_p: float = Field(0.0, ge=0, le=1)
    seed: int | None = Field(None, ge=-_INT64_MAX - 1, le=_INT64_MAX)
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = None  # each checked against the vocabulary
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    repetition_penalty: float = Field(1.0, gt=0, le=10)
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> bias
    allowed_token_ids: list[TokenId] | None = None  # vLLM: only these may be sampled
    cache_salt: str | None = None  # vLLM: the prefix cache shared only under this salt
    # vLLM: arguments for the server's --logits-processors (SamplingParams.extra_args)
    vllm_xargs: dict[str, str | int | float | list[str | int | float]] | None = None
    include_stop_str_in_output: bool = False  # vLLM: keep the stop string or token's text
    skip_special_tokens: bool = True  # vLLM: leave special tokens' text out
    # vLLM's; no effect: fast tokenizers (tidal's) join special tokens with no space between
    spaces_between_special_tokens: bool = True
    truncate_prompt_tokens: int | None = Field(None, ge=-1)  # vLLM: keep the last k tokens
    return_token_ids: bool = False  # vLLM: the prompt's and the output's token ids too
    return_tokens_as_token_ids: bool = False  # vLLM: logprobs name tokens "token_id:<id>"
    bad_words: list[str] = []  # vLLM: words the output must not hold
    prompt_logprobs: int | None = Field(None, ge=0)  # vLLM: per prompt token, top k
    n: int = Field(1, ge=1)  # with use_beam_search, the beam width
    use_beam_search: bool = False  # vLLM: the n best answers by beam search
    length_penalty: float = Field(1.0, allow_inf_nan=False)  # vLLM: beam score's divisor
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    priority: int = Field(0, ge=-_INT64_MAX - 1, le=_INT64_MAX)
    min_tokens: int = Field(0, ge=0)
    user: str | None = None  # harmless: an end-user id for abuse monitoring
    kv_transfer_params: dict | None = None  # P/D: {"prefill_address": ...}, set by the router
    ttft_slo_ms: float | None = Field(None, gt=0, le=1e9)  # only with --policy slo
    tpot_slo_ms: float | None = Field(None, gt=0, le=1e9)
    # Output constraints (structured.py): OpenAI's, and vLLM's extensions.
    response_format: dict | None = None
    structured_outputs: dict | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    _constraint: tuple[str, tuple[str, str]] | None = PrivateAttr(None)
    _model_max_tokens: int | None = PrivateAttr(None)  # generation_config's max_new_tokens

    def with_defaults(self, defaults: Mapping[str, float | int]) -> None:
        """Take the model's sampling defaults (generation_config.json, ModelConfig.
        generation_config) in the fields this request leaves unset; `max_tokens` among them
        is the output limit when the request gives none."""
        for name, value in defaults.items():
            if name == "max_tokens":
                self._model_max_tokens = int(value)
            elif name not in self.model_fields_set:
                setattr(self, name, value)

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
    def _beam_search_fields(self) -> "GenerationRequest":
        """What a beam search cannot honour is a 400 (refusals.BEAM_SEARCH_REFUSED), and so
        is length_penalty without one."""
        if not self.use_beam_search:
            if self.length_penalty != 1:
                raise refuse("length_penalty", "length_penalty needs use_beam_search=true")
            return self
        for name, (allowed, why) in BEAM_SEARCH_REFUSED.items():
            value = getattr(self, name, None)
            if value is not None and not _passes(value, allowed):
                raise refuse(name, f"{name} does not go with use_beam_search: {why}")
        if self._constraint is not None:
            raise refuse(self._constraint[0], f"{self._constraint[0]} does not go with "
                                              "use_beam_search: outputs are not constrained")
        if self.max_tokens == 0:
            raise refuse("max_tokens", "use_beam_search needs max_tokens of at least 1")
        if self.allowed_token_ids is not None and len(set(self.allowed_token_ids)) < self.n:
            raise refuse("allowed_token_ids", f"{self.n} beams need at least {self.n} "
                                              "allowed_token_ids to choose from")
        return self

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> "GenerationRequest":
        if self.stream_options is not None and not self.stream:
            raise refuse("stream_options", "stream_options is only allowed with stream=true")
        return self

    @model_validator(mode="after")
    def _request_id_is_text(self) -> "GenerationRequest":
        if self.request_id is not None and not is_unicode(self.request_id):
            raise refuse("request_id", "request_id: the text is not valid Unicode (a lone "
                                       "surrogate)")
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

    def output_limit(self) -> int | None:
        """The output tokens asked for (None: the endpoint's default)."""
        return self.max_tokens

    def num_logprobs(self) -> int | None:
        """Alternatives per output token to report (0: the chosen token's only), None for
        no logprobs."""
        return None

    def prediction_ids(self) -> list[int] | None:
        """The tokens of a predicted output (chat's `prediction`), None without one."""
        return None

    def to_sampling_params(self, limits: ServerConfig, prompt_len: int, max_model_len: int,
                           vocab_size: int) -> SamplingParams:
        """The engine's parameters for one prompt of this request, checked against the
        server's limits (max_n, max_total_tokens, max_stop_strings, max_stop_length) and the
        model's context and vocabulary: an APIError (400) names the field at fault."""
        max_tokens, logprobs = self.output_limit(), self.num_logprobs()
        if self.n > limits.max_n:
            raise APIError(f"n must be at most {limits.max_n}, got {self.n}", param="n")
        room = max_model_len - prompt_len
        if room < 1:
            raise APIError(f"the prompt has {prompt_len} tokens; this model's context is "
                           f"{max_model_len} tokens", param=self.prompt_field)
        field, cap = self.limit_field(), limits.max_total_tokens
        if max_tokens is None:
            given = (self.default_max_tokens, self._model_max_tokens)
            max_tokens = min([room, *(d for d in given if d is not None)])
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
        most = limits.max_logprobs if limits.max_logprobs >= 0 else vocab_size
        for name, asked in ((self.logprobs_field, logprobs),
                            ("prompt_logprobs", self.prompt_logprob_count())):
            if asked is not None and asked > most:
                raise APIError(f"{name} must be at most {most} (the server's --max-logprobs), "
                               f"got {asked}", param=name)
        check_token_ids(self.stop_token_ids or [], vocab_size, "stop_token_ids")
        check_token_ids(self.allowed_token_ids or [], vocab_size, "allowed_token_ids")
        if self.cache_salt is not None and not is_unicode(self.cache_salt):
            raise APIError("cache_salt: the text is not valid Unicode (a lone surrogate)",
                           param="cache_salt")
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
        # bad words cost a check a step each, as stop strings do: the same limits
        if len(self.bad_words) > limits.max_stop_strings or any(
                len(w) > limits.max_stop_length or not is_unicode(w) for w in self.bad_words):
            raise APIError(f"bad_words takes at most {limits.max_stop_strings} words of valid "
                           f"Unicode, each at most {limits.max_stop_length} characters",
                           param="bad_words")
        try:
            return SamplingParams(
                max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p,
                top_k=self.top_k, min_p=self.min_p, seed=self.seed, n=self.n,
                stop_token_ids=list(self.stop_token_ids or []), ignore_eos=self.ignore_eos,
                stop=stop, priority=self.priority, presence_penalty=self.presence_penalty,
                frequency_penalty=self.frequency_penalty,
                repetition_penalty=self.repetition_penalty, logprobs=logprobs,
                prompt_logprobs=self.prompt_logprob_count(),
                min_tokens=self.min_tokens, logit_bias=self.token_bias(vocab_size),
                allowed_token_ids=self.allowed_token_ids, cache_salt=self.cache_salt,
                extra_args=self.vllm_xargs, prediction=self.prediction_ids(),
                bad_words=self.bad_words,
                include_stop_str_in_output=self.include_stop_str_in_output,
                skip_special_tokens=self.skip_special_tokens,
                structured=self._constraint and self._constraint[1],
                ttft_slo_ms=self.ttft_slo_ms,
                tpot_slo_ms=self.tpot_slo_ms)
        except ValueError as exc:  # its messages start with the field's name
            word = str(exc).split(" ", 1)[0]
            param = word if word in type(self).model_fields else None
            raise APIError(str(exc), param=param) from exc

    def prompt_logprob_count(self) -> int | None:
        """Alternatives per prompt token the engine computes, None for no prompt logprobs."""
        return self.prompt_logprobs

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
        if self.use_beam_search:  # its steps are prefills of their own
            raise APIError("use_beam_search is not supported with prefill/decode "
                           "disaggregation", param="use_beam_search")


class CompletionRequest(GenerationRequest):
    """A /v1/completions body."""

    _refused: ClassVar = {**VLLM_REFUSED, **COMPLETION_REFUSED}
    default_max_tokens: ClassVar[int | None] = 16  # OpenAI's legacy completions default

    prompt: Text | Annotated[list[Text], Field(min_length=1)] | TokenIds | \
        Annotated[list[TokenIds], Field(min_length=1)]
    logprobs: int | None = Field(None, ge=0)
    best_of: int | None = Field(None, ge=1)  # only equal to n: the best n of n are all n
    echo: bool = False  # the prompt before the output (and its logprobs with logprobs)
    add_special_tokens: bool = True  # vLLM: the tokenizer's BOS and the like for strings

    @model_validator(mode="after")
    def _best_of(self) -> "CompletionRequest":
        if self.best_of is not None and self.best_of < self.n:
            raise refuse("best_of", f"best_of ({self.best_of}) must be at least n ({self.n})")
        if self.best_of is not None and self.best_of > self.n:
            raise refuse("best_of", f"best_of > n is not supported: tidal does not rank "
                                    f"candidates (accepted: null or n, {self.n})")
        return self

    def num_logprobs(self) -> int | None:
        return self.logprobs

    def prompt_logprob_count(self) -> int | None:
        """echo with logprobs needs the prompt's, with as many alternatives."""
        if self.echo and self.logprobs is not None:
            return max(self.logprobs, self.prompt_logprobs or 0)
        return self.prompt_logprobs

    @property
    def prompt_only(self) -> bool:
        """Whether only the prompt is answered: echo with max_tokens 0 (what evaluation
        harnesses send to score a prompt) samples one token and drops it."""
        return self.echo and self.max_tokens == 0

    def output_limit(self) -> int | None:
        return 1 if self.prompt_only else self.max_tokens

    def prompt_strings(self) -> list[str] | None:
        """The prompts as sent when they are text (what echo repeats), else None."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        return list(p) if p and all(isinstance(x, str) for x in p) else None

    def prompt_ids(self, tokenizer) -> list[list[int]]:
        return prompt_lists(self.prompt, tokenizer, self.add_special_tokens, "prompt")


class DetokenizeRequest(StrictModel):
    """POST /detokenize: token ids back to text."""

    model: str | None = None
    tokens: list[TokenId]
