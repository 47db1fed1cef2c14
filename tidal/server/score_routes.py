"""The scoring routes: vLLM's `/v1/score` (also `/score`) and `/classify`, and the rerank
endpoint Cohere, Jina, vLLM and llama.cpp serve (`/v1/rerank`, `/rerank`, `/v2/rerank`).
What a body holds and how a pair becomes a prompt is in `scoring.py`; the `Frontend`
submits the pairs as it does embeddings, so scores batch with generation."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request

from tidal.server.frontend import FrontendDep
from tidal.server.openai.protocol import APIError
from tidal.server.scoring import ClassifyRequest, RerankRequest, ScoreRequest

routes = APIRouter()


async def _score(body: ScoreRequest | RerankRequest | ClassifyRequest, f,
                 request: Request):
    f.check_model(body.model)
    f.check_task("score")
    scorer, labels = f.client.ready.scorer, f.client.ready.labels
    if not scorer:
        raise APIError("this model has no score head: serve a *ForSequenceClassification "
                       "checkpoint, or an LLM reranker with --score-tokens (e.g. no,yes)")
    if isinstance(body, ClassifyRequest):
        if scorer != "classifier":
            raise APIError("/classify reads a *ForSequenceClassification checkpoint's head; "
                           "this model scores by answer tokens (/v1/score, /v1/rerank)")
        body.with_labels(labels)
    elif len(labels) > 1:
        raise APIError(f"this model classifies into {len(labels)} labels and scores no "
                       "pairs: POST /classify")
    # a chat template's render and the tokenizer in a thread: others keep streaming
    prompts = await asyncio.to_thread(body.prompt_ids, f.tokenizer, scorer)
    return await f.embed(body, prompts, request)


@routes.post("/v1/score")
@routes.post("/score", include_in_schema=False)
async def score(body: ScoreRequest, f: FrontendDep, request: Request):
    """vLLM's: the relevance of each (text_1, text_2) pair, in (0, 1)."""
    return await _score(body, f, request)


@routes.post("/v1/rerank")
@routes.post("/rerank", include_in_schema=False)
@routes.post("/v2/rerank", include_in_schema=False)
async def rerank(body: RerankRequest, f: FrontendDep, request: Request):
    """The documents ordered by their relevance to the query."""
    return await _score(body, f, request)


@routes.post("/classify")
@routes.post("/v1/classify", include_in_schema=False)
async def classify(body: ClassifyRequest, f: FrontendDep, request: Request):
    """vLLM's: each input's probability per label of the model's classifier head."""
    return await _score(body, f, request)
