"""`POST /v1/embeddings` bodies: strings or token ids in (or, as vLLM takes them, a
conversation through the chat template), one pooled vector per input out. Each input runs
as a request that stops after its prompt (one token, dropped) with SamplingParams.embed
set, so embeddings batch with generation on the same engine core."""

from __future__ import annotations

import base64
from typing import TYPE_CHECKING, Annotated, ClassVar, Literal

import numpy as np
from pydantic import Field, model_validator

from tidal.core import SamplingParams
from tidal.server.openai.chat import ChatMessage, chat_prompt_text, check_render
from tidal.server.openai.protocol import (APIError, StrictModel, Text, TokenIds, encode,
                                          prompt_lists, refuse)

if TYPE_CHECKING:
    from tidal.server.config import ServerConfig


class EmbeddingRequest(StrictModel):
    """An /v1/embeddings body: `input`, or vLLM's `messages` (one conversation through the
    chat template, with `add_generation_prompt`, `chat_template` and its kwargs). It
    answers the frontend's submission as a generation request would (n, sampling
    parameters, no constraint, no logprobs, no latency targets)."""

    _refused: ClassVar = {
        "normalize": ((), "the model's pooling configuration says whether it normalises"),
    }
    n: ClassVar[int] = 1
    ttft_slo_ms: ClassVar[None] = None
    tpot_slo_ms: ClassVar[None] = None
    kv_transfer_params: ClassVar[None] = None

    model: str | None = None
    input: Text | Annotated[list[Text], Field(min_length=1)] | TokenIds | \
        Annotated[list[TokenIds], Field(min_length=1)] | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_generation_prompt: bool = False  # messages only (vLLM's default for embeddings)
    chat_template: str | None = Field(None, min_length=1)  # messages only, as chat's
    chat_template_kwargs: dict | None = None  # messages only
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)
    # vLLM's: the tokenizer's BOS / EOS as it adds them (default: for input, not messages)
    add_special_tokens: bool | None = None
    user: str | None = None  # harmless: an end-user id for abuse monitoring
    truncate_prompt_tokens: int | None = Field(None, ge=-1)  # vLLM: keep the last k tokens

    @model_validator(mode="after")
    def _one_input(self) -> "EmbeddingRequest":
        if (self.input is None) == (self.messages is None):
            raise refuse("input", "send either input or messages")
        check_render(self.add_generation_prompt, False, self.chat_template_kwargs)
        return self

    @property
    def prompt_field(self) -> str:
        """What a 400 about the input names."""
        return "input" if self.input is not None else "messages"

    def check_dimensions(self, size: int, matryoshka: bool) -> None:
        """A 400 for `dimensions` the model cannot give: over its size, or any other than
        its size unless it was trained for shorter ones (Matryoshka)."""
        d = self.dimensions
        if d is None or d == size:
            return
        if d > size:
            raise APIError(f"dimensions ({d}) is over this model's {size}", param="dimensions")
        if not matryoshka:
            raise APIError(f"this model does not support dimensions other than {size}: it is "
                           "not a Matryoshka model (config.json: matryoshka_dimensions)",
                           param="dimensions")

    def prompt_ids(self, tokenizer) -> list[list[int]]:
        special = self.add_special_tokens
        if self.input is not None:
            return prompt_lists(self.input, tokenizer, special is not False, "input")
        text = chat_prompt_text(self.messages, tokenizer, self.add_generation_prompt,
                                template_args=self.chat_template_kwargs,
                                chat_template=self.chat_template)
        return [encode(tokenizer, text, bool(special), "messages")]

    def to_sampling_params(self, limits: ServerConfig, prompt_len: int, max_model_len: int,
                           vocab_size: int) -> SamplingParams:
        if prompt_len >= max_model_len:
            raise APIError(f"an input has {prompt_len} tokens; this model takes at most "
                           f"{max_model_len - 1}", param=self.prompt_field)
        return SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True,
                              embed=self.dimensions or 0)

    def output_constraint(self) -> None:
        return None

    def num_logprobs(self) -> None:
        return None

    def body(self, vectors: list[list[float]], prompts: list[list[int]], model: str) -> dict:
        """OpenAI's answer: each vector as floats or as base64 of little-endian float32."""
        data = []
        for i, v in enumerate(vectors):
            value = v if self.encoding_format == "float" else \
                base64.b64encode(np.asarray(v, dtype="<f4").tobytes()).decode()
            data.append({"object": "embedding", "index": i, "embedding": value})
        tokens = sum(len(p) for p in prompts)
        return {"object": "list", "data": data, "model": model,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}
