"""`/v1/score` (vLLM's) and `/v1/rerank` (the Cohere and Jina shape vLLM and llama.cpp
serve) bodies: each (query, document) pair is one prompt, run as a request that stops after
its prompt with SamplingParams.score set, so scores batch with generation on the same
engine core. The model's score head (tidal.model.score_head) reads the prompt's last
token; how a pair becomes a prompt depends on the head (tidal/model/score_prompts.py)."""

from __future__ import annotations

import time
import uuid
from typing import TYPE_CHECKING, Annotated, Any, ClassVar

from pydantic import Field, PrivateAttr, model_validator

from tidal.core import SamplingParams
from tidal.model.score_prompts import pair_ids, score_pairs, score_params
from tidal.server.openai.protocol import APIError, StrictModel, TokenIds, refuse

if TYPE_CHECKING:
    from tidal.server.config import ServerConfig

Texts = Annotated[list[str], Field(min_length=1)]


class _HeadRead(StrictModel):
    """What the bodies the score head answers share: the frontend submits them as it does
    embeddings (one prompt-only request each, no constraint, no logprobs)."""

    prompt_field: ClassVar[str] = "documents"
    n: ClassVar[int] = 1
    ttft_slo_ms: ClassVar[None] = None
    tpot_slo_ms: ClassVar[None] = None
    kv_transfer_params: ClassVar[None] = None

    model: str | None = None

    def to_sampling_params(self, limits: ServerConfig, prompt_len: int, max_model_len: int,
                           vocab_size: int) -> SamplingParams:
        if prompt_len >= max_model_len:
            raise APIError(f"a prompt of {prompt_len} tokens; this model takes at most "
                           f"{max_model_len - 1}", param=self.prompt_field)
        return score_params()

    def output_constraint(self) -> None:
        return None

    def num_logprobs(self) -> None:
        return None


class _Scoring(_HeadRead):
    """/v1/score's and /v1/rerank's: each (query, document) pair one prompt."""

    truncate_prompt_tokens: ClassVar[None] = None  # a pair's query would be cut first

    instruction: str | None = None  # tidal's: an LLM reranker's <Instruct> line

    def pairs(self) -> list[tuple[str, str]]:
        raise NotImplementedError

    def prompt_ids(self, tokenizer, scorer: str) -> list[list[int]]:
        return [pair_ids(tokenizer, scorer, q, d, self.instruction) for q, d in self.pairs()]


class ScoreRequest(_Scoring):
    """vLLM's /v1/score: `text_1` against each of `text_2` (one text_1), or pair by pair
    (lists of one length)."""

    prompt_field: ClassVar[str] = "text_2"

    text_1: str | Texts
    text_2: str | Texts
    encoding_format: str | None = None  # harmless: scores are floats either way
    user: str | None = None

    @model_validator(mode="after")
    def _lengths(self) -> "ScoreRequest":
        if isinstance(self.text_1, list) and isinstance(self.text_2, list) and \
                len(self.text_1) not in (1, len(self.text_2)):
            raise refuse("text_1", f"text_1 holds {len(self.text_1)} texts and text_2 "
                                   f"{len(self.text_2)}: one, or as many as text_2")
        if isinstance(self.text_1, list) and isinstance(self.text_2, str) and \
                len(self.text_1) != 1:
            raise refuse("text_1", "text_1 holds several texts for one text_2")
        return self

    def pairs(self) -> list[tuple[str, str]]:
        return score_pairs(self.text_1, self.text_2)

    def body(self, vectors: list[list[float]], prompts: list[list[int]], model: str) -> dict:
        """vLLM's answer: a score per pair, in the pairs' order."""
        scores, tokens = [v[0] for v in vectors], sum(map(len, prompts))
        return {"id": f"score-{uuid.uuid4().hex}", "object": "list",
                "created": int(time.time()), "model": model,
                "data": [{"index": i, "object": "score", "score": s}
                         for i, s in enumerate(scores)],
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


class RerankRequest(_Scoring):
    """The rerank body Cohere, Jina, vLLM and llama.cpp take: `query`, `documents` (texts,
    or objects with a `text`), `top_n`, `return_documents`."""

    query: str
    documents: Annotated[list[str | dict[str, Any]], Field(min_length=1)]
    top_n: int | None = Field(None, ge=1)
    return_documents: bool = True
    max_chunks_per_doc: int | None = None  # harmless (Cohere v1): documents are not chunked
    rank_fields: list[str] | None = None  # harmless unless a document is an object

    @model_validator(mode="after")
    def _documents(self) -> "RerankRequest":
        for i, d in enumerate(self.documents):
            if isinstance(d, dict) and not isinstance(d.get("text"), str):
                raise refuse(f"documents.{i}", "a document is a text or an object with a "
                                               "text")
        return self

    def texts(self) -> list[str]:
        return [d if isinstance(d, str) else d["text"] for d in self.documents]

    def pairs(self) -> list[tuple[str, str]]:
        return [(self.query, d) for d in self.texts()]

    def body(self, vectors: list[list[float]], prompts: list[list[int]], model: str) -> dict:
        """The documents by relevance, most relevant first, `top_n` of them."""
        scores = [v[0] for v in vectors]
        order = sorted(range(len(scores)), key=lambda i: -scores[i])[:self.top_n]
        texts = self.texts()
        results = [{"index": i, "relevance_score": scores[i],
                    **({"document": {"text": texts[i]}} if self.return_documents else {})}
                   for i in order]
        tokens = sum(map(len, prompts))
        return {"id": f"rerank-{uuid.uuid4().hex}", "model": model, "results": results,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


class ClassifyRequest(_HeadRead):
    """vLLM's /classify: each input through a classifier head, its probability per label
    (softmax over the head's logits; one label: its sigmoid)."""

    prompt_field: ClassVar[str] = "input"

    input: str | Texts | TokenIds | Annotated[list[TokenIds], Field(min_length=1)]
    truncate_prompt_tokens: int | None = Field(None, ge=-1)  # vLLM: keep the last k tokens
    user: str | None = None  # harmless
    priority: int = 0  # harmless: classifications are one step each
    _labels: tuple[str, ...] = PrivateAttr(())

    def prompt_ids(self, tokenizer, scorer: str) -> list[list[int]]:
        texts = [self.input] if isinstance(self.input, str) or (
            self.input and isinstance(self.input[0], int)) else self.input
        return [tokenizer.encode(t) if isinstance(t, str) else list(t) for t in texts]

    def with_labels(self, labels: list[str]) -> "ClassifyRequest":
        self._labels = tuple(labels)
        return self

    def body(self, vectors: list[list[float]], prompts: list[list[int]], model: str) -> dict:
        """vLLM's answer: each input's most probable label and every label's probability."""
        data = [{"index": i, "label": self._labels[max(range(len(p)), key=p.__getitem__)],
                 "probs": p, "num_classes": len(p)} for i, p in enumerate(vectors)]
        tokens = sum(map(len, prompts))
        return {"id": f"classify-{uuid.uuid4().hex}", "object": "list",
                "created": int(time.time()), "model": model, "data": data,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}
