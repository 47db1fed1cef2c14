"""SGLang's native requests: `POST /generate` (prompts as `text` or `input_ids`, one or a
batch, one `sampling_params` object, logprobs asked for by `return_logprob`) runs as the
completions request it translates into (`completion_request`), so it is checked as one is,
and a 400 names the field as SGLang's clients send it; `POST /encode` runs as an
embeddings request. What the server cannot honour (images, embeddings as input, custom
logit processors) is refused by name."""

from __future__ import annotations

import uuid
from typing import Annotated, Any, ClassVar, Literal

from pydantic import Field, PrivateAttr, ValidationError, model_validator

from tidal.server.openai.embeddings import EmbeddingRequest
from tidal.server.openai.protocol import (APIError, CompletionRequest, StrictModel, Text,
                                          TokenIds, refuse)
from tidal.server.openai.renaming import in_terms, renamed_error

# SGLang's sampling parameter -> the completions field it sets
SAMPLING = {
    "max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens", "stop": "stop",
    "stop_token_ids": "stop_token_ids", "temperature": "temperature", "top_p": "top_p",
    "top_k": "top_k", "min_p": "min_p", "frequency_penalty": "frequency_penalty",
    "presence_penalty": "presence_penalty", "repetition_penalty": "repetition_penalty",
    "n": "n", "ignore_eos": "ignore_eos", "skip_special_tokens": "skip_special_tokens",
    "spaces_between_special_tokens": "spaces_between_special_tokens",
    "no_stop_trim": "include_stop_str_in_output", "json_schema": "guided_json",
    "regex": "guided_regex", "ebnf": "guided_grammar", "logit_bias": "logit_bias",
    "sampling_seed": "seed"}
# SGLang's sampling parameters tidal does not run, and why
_REFUSED_SAMPLING = {
    "structural_tag": "structural tags are not supported; constrain the output with "
                      "json_schema, regex or ebnf",
    "custom_params": "custom logit processors are not run from a request here (the "
                     "server's --logits-processors read vllm_xargs on /v1/completions)"}
# a completions field -> where a 400 points in a /generate body, and its name in a message
PARAMS = {field: f"sampling_params.{name}" for name, field in SAMPLING.items()}
PARAMS.update(logprobs="top_logprobs_num", prompt_logprobs="top_logprobs_num")
WORDS = {field: name for name, field in SAMPLING.items() if field != name}
WORDS.update(logprobs="top_logprobs_num", prompt_logprobs="top_logprobs_num")

_TEXT_ONLY = "this server runs a text-only model"


class NativeCompletion(CompletionRequest):
    """The completions request a /generate body runs as: SGLang's default of 128 new
    tokens, and `max_new_tokens: 0` answers the prompt alone (its logprobs)."""

    default_max_tokens: ClassVar[int | None] = 128
    prompt_field: ClassVar[str] = "text"

    @property
    def prompt_only(self) -> bool:
        return self.max_tokens == 0


class NativeIdsCompletion(NativeCompletion):
    """One whose prompts came as token ids."""

    prompt_field: ClassVar[str] = "input_ids"


_MEDIA = {"image_data": ((), _TEXT_ONLY), "audio_data": ((), _TEXT_ONLY),
          "video_data": ((), _TEXT_ONLY),
          "input_embeds": ((), "prompts are text or token ids here")}


class NativePrompts(StrictModel):
    """What SGLang's native bodies share: one prompt or a batch as `text` or `input_ids`,
    `rid` naming each prompt's answer, `model` (or /generate's `lora_path`) an adapter."""

    _refused: ClassVar = _MEDIA

    text: Text | Annotated[list[Text], Field(min_length=1)] | None = None
    input_ids: TokenIds | Annotated[list[TokenIds], Field(min_length=1)] | None = None
    rid: str | Annotated[list[str], Field(min_length=1)] | None = None
    model: str | None = None

    @model_validator(mode="after")
    def _one_prompt_field(self) -> "NativePrompts":
        if (self.text is None) == (self.input_ids is None):
            raise refuse("text", "send the prompt as text or as input_ids (one of them)")
        count = self.num_prompts()
        if isinstance(self.rid, list) and (len(self.rid) != count
                                           or len(set(self.rid)) != count):
            raise refuse("rid", f"rid must name each of the {count} prompts once")
        if isinstance(self.rid, str) and count > 1:
            raise refuse("rid", f"a batch of {count} prompts takes a list of rids")
        return self

    def prompt(self):
        return self.text if self.text is not None else self.input_ids

    def prompt_name(self) -> str:
        return "text" if self.text is not None else "input_ids"

    def adapter(self) -> str | None:
        return self.model

    def num_prompts(self) -> int:
        if self.text is not None:
            return 1 if isinstance(self.text, str) else len(self.text)
        return len(self.input_ids) if isinstance(self.input_ids[0], list) else 1

    def is_batch(self) -> bool:
        """Whether the prompts came as a list (the answer is then a list too)."""
        if self.text is not None:
            return isinstance(self.text, list)
        return isinstance(self.input_ids[0], list)

    def rids(self) -> list[str] | None:
        """Each prompt's id as the client named it (None: the server names them)."""
        return [self.rid] if isinstance(self.rid, str) else self.rid


class GenerateRequest(NativePrompts):
    """A /generate body: SGLang's GenerateReqInput, text-only. `lora_path` (the adapter's
    served name) or `model` picks a LoRA adapter; `kv_transfer_params` is the P/D
    router's, as on /v1/completions."""

    _refused: ClassVar = {
        **_MEDIA,
        "custom_logit_processor": ((), _REFUSED_SAMPLING["custom_params"]),
        "return_hidden_states": ((False,), "hidden states are not returned"),
        "token_ids_logprob": ((), "logprobs are of the sampled and the top tokens; ask "
                                  "top_logprobs_num")}

    sampling_params: dict[str, Any] | Annotated[list[dict[str, Any]],
                                                Field(min_length=1)] | None = None
    stream: bool = False
    return_logprob: bool = False
    logprob_start_len: int = Field(-1, ge=-1)  # -1: the output's logprobs only
    top_logprobs_num: int = Field(0, ge=0)
    return_text_in_logprobs: bool = False
    lora_path: str | None = None
    kv_transfer_params: dict | None = None

    @model_validator(mode="after")
    def _one_sampling(self) -> "GenerateRequest":
        count, params = self.num_prompts(), self.sampling_params
        if isinstance(params, list) and len(params) != count:
            raise refuse("sampling_params", f"sampling_params: one object, or one for each "
                                            f"of the {count} prompts")
        if isinstance(params, list) and any(p != params[0] for p in params):
            raise refuse("sampling_params", "a batch's prompts share their sampling_params "
                                            "here: send prompts that differ as requests of "
                                            "their own")
        return self

    def adapter(self) -> str | None:
        return self.lora_path or self.model

    def completion_request(self) -> NativeCompletion:
        """The completions request this body runs as."""
        params = self.sampling_params or {}
        if isinstance(params, list):
            params = params[0]
        body: dict[str, Any] = {"model": self.adapter(), "stream": self.stream,
                                "prompt": self.prompt()}
        for name, value in params.items():
            if name in _REFUSED_SAMPLING and value is not None:
                raise APIError(f"sampling_params.{name} is not supported: "
                               f"{_REFUSED_SAMPLING[name]}", param=f"sampling_params.{name}")
            if name not in SAMPLING and name not in _REFUSED_SAMPLING:
                raise APIError(f"sampling_params.{name} is not a sampling parameter",
                               param=f"sampling_params.{name}")
            body[SAMPLING.get(name, name)] = value
        if self.return_logprob:
            body["logprobs"] = self.top_logprobs_num
            if self.logprob_start_len >= 0:
                body["prompt_logprobs"] = self.top_logprobs_num
        if self.kv_transfer_params is not None:
            body["kv_transfer_params"] = self.kv_transfer_params
        cls = NativeCompletion if self.text is not None else NativeIdsCompletion
        try:
            return cls.model_validate(body)
        except ValidationError as exc:
            raise renamed_error(exc, PARAMS, WORDS) from None


def in_sglang_terms(exc: APIError) -> APIError:
    """A check's 400 on the translated request, naming SGLang's fields."""
    return in_terms(exc, PARAMS, WORDS)


class NativeEmbedding(EmbeddingRequest):
    """The embeddings request a /encode body runs as, answered in SGLang's shape."""

    _rids: list[str] | None = PrivateAttr(None)
    _batch: bool = PrivateAttr(False)

    def body(self, vectors: list[list[float]], prompts: list[list[int]], model: str):
        ids = self._rids or [uuid.uuid4().hex for _ in prompts]
        outs = [{"embedding": v, "meta_info": {"id": rid, "prompt_tokens": len(p)}}
                for v, p, rid in zip(vectors, prompts, ids)]
        return outs if self._batch else outs[0]


class EncodeRequest(NativePrompts):
    """A /encode body: SGLang's EmbeddingReqInput, text-only; `dimensions` as OpenAI's
    (a Matryoshka model's leading ones)."""

    dimensions: int | None = Field(None, ge=1)

    def embedding_request(self) -> NativeEmbedding:
        out = NativeEmbedding.model_validate({"model": self.model, "input": self.prompt(),
                                              "dimensions": self.dimensions})
        out._rids, out._batch = self.rids(), self.is_batch()
        return out


def prompt_error(exc: APIError, body: NativePrompts) -> APIError:
    """An embeddings check's 400 about its `input`, naming the /encode body's field."""
    return in_terms(exc, {"input": body.prompt_name()}) if exc.param == "input" else exc


class AbortRequest(StrictModel):
    """A /abort_request body: SGLang's AbortReq. `rid` names a request (a /generate
    prompt's rid, vLLM's request_id or the answer's id), `abort_all` ends every one;
    `abort_message` goes into their finish_reason."""

    rid: str = ""
    abort_all: bool = False
    abort_message: str | None = None


class PauseGeneration(StrictModel):
    """A /pause_generation body: SGLang's PauseGenerationReqInput. `abort` ends the requests
    in flight answered with what they have; `in_place` holds them where they are until
    /continue_generation."""

    mode: Literal["abort", "in_place", "retract"] = "abort"

    @model_validator(mode="after")
    def _runs(self) -> "PauseGeneration":
        if self.mode == "retract":  # KV freed, to compute again at the resume: not here
            raise refuse("mode", "mode 'retract' is not supported; pause with 'in_place' "
                                 "(requests keep their KV) or 'abort'")
        return self


class MemoryTags(StrictModel):
    """A /release_memory_occupation or /resume_memory_occupation body: the parts SGLang
    frees or loads one by one ("weights", "kv_cache"); here every part goes together."""

    tags: list[Literal["weights", "kv_cache", "cuda_graph"]] | None = None
