"""Amazon SageMaker's serving contract, as vLLM serves it: `/ping` answers as /health (in
api.py), and `POST /invocations` takes any body one of the server's endpoints takes (a chat,
a completion, embeddings, a classification, a score or a rerank) and answers as that
endpoint would, streamed where it streams. The P/D router serves both too (pd_routes.py)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from fastapi import APIRouter, Request
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from tidal.server.frontend import Frontend, FrontendDep
from tidal.server.generation_routes import chat, completions, embeddings
from tidal.server.openai.chat import ChatRequest
from tidal.server.openai.embeddings import EmbeddingRequest
from tidal.server.openai.protocol import APIError, CompletionRequest, StrictModel
from tidal.server.openapi import BODIES_OF
from tidal.server.score_routes import classify, rerank, score
from tidal.server.scoring import ClassifyRequest, RerankRequest, ScoreRequest


@dataclass(frozen=True)
class Kind:
    """A body /invocations takes: the endpoint answering it, its model, the field that
    names it (whose errors are reported when no kind takes the body) and the task it
    needs of a server started with --task."""

    path: str
    model: type[StrictModel]
    field: str
    task: str


# in the order a body is tried (vLLM's): a body that two kinds take goes to the first
KINDS = (Kind("/v1/chat/completions", ChatRequest, "messages", "generate"),
         Kind("/v1/completions", CompletionRequest, "prompt", "generate"),
         Kind("/v1/embeddings", EmbeddingRequest, "input", "embed"),
         Kind("/classify", ClassifyRequest, "input", "score"),
         Kind("/v1/score", ScoreRequest, "text_1", "score"),
         Kind("/v1/rerank", RerankRequest, "query", "score"))


async def read_invocation(request: Request,
                          kinds: Sequence[Kind] = KINDS) -> tuple[Kind, StrictModel]:
    """The first of `kinds` whose model takes the body, and the body as that model. None
    taking it: the validation errors of the first kind whose field the body has (a 400
    naming the field at fault), else a 400 naming the kinds."""
    try:
        raw = await request.json()
    except ValueError as exc:
        raise APIError(f"the body is not valid JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise APIError("the body must be a JSON object")
    named: ValidationError | None = None
    for kind in kinds:
        try:
            return kind, kind.model.model_validate(raw)
        except ValidationError as exc:
            if named is None and kind.field in raw:
                named = exc
    if named is not None:  # as FastAPI reports a route's body: the error handler's format
        raise RequestValidationError([{**e, "loc": ("body", *e["loc"])}
                                      for e in named.errors()])
    paths: dict[str, list[str]] = {}
    for kind in kinds:
        paths.setdefault(kind.field, []).append(kind.path)
    fields = ", ".join(f"`{field}` ({', '.join(at)})" for field, at in paths.items())
    raise APIError(f"the body is none that this server takes: it needs one of {fields}")


def _served_first(f: Frontend) -> list[Kind]:
    """KINDS, those of the server's task (and of its model: a score head) first, so that a
    body two kinds take goes to the one served; a body only an unserved kind takes still
    reaches that endpoint, which says what the server serves."""
    scorer = f.client.ready.scorer

    def served(kind: Kind) -> bool:
        if f.config.task not in ("auto", kind.task):
            return False
        if kind.path == "/classify":
            return scorer == "classifier"
        return kind.task != "score" or bool(scorer)
    return sorted(KINDS, key=lambda kind: not served(kind))


_ENDPOINTS = {"/v1/chat/completions": chat, "/v1/completions": completions,
              "/v1/embeddings": embeddings, "/classify": classify, "/v1/score": score,
              "/v1/rerank": rerank}
routes = APIRouter()


# the schema's body: any of theirs
SCHEMA = {"openapi_extra": {BODIES_OF: [kind.path for kind in KINDS]}}


@routes.post("/invocations", **SCHEMA)
async def invocations(f: FrontendDep, request: Request):
    """SageMaker's: a chat, completion, embeddings, classify, score or rerank body,
    answered as its own endpoint answers it."""
    kind, body = await read_invocation(request, _served_first(f))
    return await _ENDPOINTS[kind.path](body, f, request)
