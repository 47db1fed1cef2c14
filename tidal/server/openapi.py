"""The OpenAPI schema as the server answers: FastAPI's generated one, corrected where the
server differs from FastAPI's defaults. Invalid bodies are 400s with an OpenAI error body
(Anthropic's on its Messages routes; never 422), generation may answer 429 and 503 and
stream as SSE, lookups by id 404, /metrics is Prometheus text, a request field sent as null
counts as absent, and the served model (and its LoRA adapters) the only `model` accepted."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from tidal.server.anthropic.protocol import PREFIX as ANTHROPIC_PREFIX
from tidal.server.errors import UNVERSIONED

_ERROR = {"$ref": "#/components/schemas/ErrorResponse"}
_ERROR_SCHEMA = {
    "type": "object", "required": ["error"], "title": "ErrorResponse",
    "properties": {"error": {
        "type": "object", "required": ["message", "type", "code"],
        "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                       "param": {"type": ["string", "null"]},
                       "code": {"type": ["string", "null"]}}}}}
_ANTHROPIC_ERROR = {"$ref": "#/components/schemas/AnthropicErrorResponse"}
_ANTHROPIC_ERROR_SCHEMA = {  # the Messages routes' (tidal/server/anthropic/protocol.py)
    "type": "object", "required": ["type", "error"], "title": "AnthropicErrorResponse",
    "properties": {"type": {"const": "error"}, "error": {
        "type": "object", "required": ["type", "message"],
        "properties": {"type": {"type": "string"}, "message": {"type": "string"}}}}}
_ERRORS = {  # status -> when, for the routes each applies to
    "400": "the body is invalid (the message names the field, `param`), or the server cannot "
           "do what the route asks (the message says why)",
    "401": "the API key is missing or wrong (a server started with --api-key)",
    "404": "no such model (this server serves one), stored response, file or batch",
    "409": "the batch has ended: it can no longer be cancelled",
    "413": "the body is over --max-body-bytes",
    "429": "too many requests in flight (--max-pending); retry after Retry-After",
    "503": "the engine core is restarting (with Retry-After) or gone",
}
_ANY: dict = {}
_TEXT = {  # routes whose 200 is not JSON: its media type and schema
    "/metrics": ("text/plain", {"type": "string"}),
    "/dashboard": ("text/html", {"type": "string"}),
    "/dashboard/stream": ("text/event-stream", _ANY),  # each event's data: a JSON report
    "/v1/files/{file_id}/content": ("application/octet-stream",
                                    {"type": "string", "format": "binary"}),
}
# a 200 of no body
_EMPTY = ("/reset_prefix_cache", "/health_generate", "/abort_request", "/sleep", "/wake_up",
          "/release_memory_occupation", "/resume_memory_occupation", "/start_profile",
          "/stop_profile")
# what else a route without parameters may answer: /health_generate 503 when the engine makes
# no token, 400 on a P/D instance; /stop_profile 400 without --profiler-dir; a wake 503
# when a core does not start
_ALSO = {"/health_generate": ["400", "503"], "/stop_profile": ["400"], "/wake_up": ["503"],
         "/resume_memory_occupation": ["503"]}
_GENERATION = ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages",
               "/generate", "/invocations")
# a route that parses its own body, any of these routes' (SageMaker's /invocations): its
# openapi_extra names them, and the schema says that its body is one of theirs
BODIES_OF = "x-bodies-of"
# may answer 429, 503
_QUEUED = _GENERATION + ("/v1/embeddings", "/v1/score", "/v1/rerank", "/classify",
                         "/encode")
# bodies whose `model` is looked up: 404 for one not served
_MODEL_ROUTES = _QUEUED + ("/tokenize", "/detokenize", "/v1/messages/count_tokens")
_LOOKED_UP = ("/v1/models/", "/v1/responses", "/v1/files", "/v1/batches")  # may answer 404
_KEYED = ("/v1/", "/v2/", "/dashboard") + UNVERSIONED


def install_schema(app: FastAPI, served_model: list[str] | str | None, keyed: bool) -> None:
    """Serve the corrected schema at /openapi.json (built once, on first request).
    `served_model`: the names `model` takes (the model's and its LoRA adapters'); None for
    any (the P/D router, which relays to servers, and a server loading adapters at run
    time)."""

    def schema() -> dict[str, Any]:
        if app.openapi_schema is None:
            raw = get_openapi(title=app.title, version=app.version, routes=app.routes)
            app.openapi_schema = corrected(raw, served_model, keyed)
        return app.openapi_schema

    app.openapi = schema  # type: ignore[method-assign]


def corrected(raw: dict[str, Any], served_model: str | None, keyed: bool) -> dict[str, Any]:
    """`raw` (FastAPI's schema) as the server behaves; see the module's docstring."""
    schemas = raw.setdefault("components", {}).setdefault("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):
        schemas.pop(name, None)
    schemas["ErrorResponse"] = _ERROR_SCHEMA
    schemas["AnthropicErrorResponse"] = _ANTHROPIC_ERROR_SCHEMA
    paths = raw.get("paths", {})
    for path, operations in paths.items():
        for op in operations.values():
            responses = op.setdefault("responses", {})
            has_body = responses.pop("422", None) is not None
            if BODIES_OF in op:
                has_body = True
                op["requestBody"] = {"required": True, "content": {"application/json": {
                    "schema": {"anyOf": [
                        paths[p]["post"]["requestBody"]["content"]["application/json"]["schema"]
                        for p in op.pop(BODIES_OF)]}}}}
            errors = (["400", "413"] if has_body else []) + (
                ["401"] if keyed and path.startswith(_KEYED) else []) + (
                ["429", "503"] if path in _QUEUED else []) + (
                ["404"] if path.startswith(_LOOKED_UP) or path in _MODEL_ROUTES else []) + (
                ["409"] if path.endswith("/cancel") else []) + (
                _ALSO.get(path, []))
            shape = _ANTHROPIC_ERROR if path.startswith(ANTHROPIC_PREFIX) else _ERROR
            for status in errors:
                responses[status] = {"description": _ERRORS[status],
                                     "content": {"application/json": {"schema": shape}}}
            ok = responses.get("200", {})
            if path in _TEXT:
                media, body = _TEXT[path]
                ok["content"] = {media: {"schema": body}}
            elif path in _EMPTY:
                ok.pop("content", None)
            elif path in _GENERATION:  # stream: true answers with server-sent events
                ok.setdefault("content", {})["text/event-stream"] = {"schema": _ANY}
    for model in schemas.values():
        if model.get("additionalProperties") is False:  # a request body (StrictModel)
            _nulls_are_absent(model, served_model)
    return raw


def _nulls_are_absent(model: dict[str, Any], served_model: str | None) -> None:
    """A request model's fields as the server reads them: null as if absent, so every
    optional field also takes null; `model`, where given, names the served model."""
    required = set(model.get("required", ()))
    for name, prop in model.get("properties", {}).items():
        if name == "model" and served_model is not None:
            names = [served_model] if isinstance(served_model, str) else list(served_model)
            prop.clear()
            prop.update({"anyOf": [{"type": "string", "enum": names},
                                   {"type": "null"}], "title": "Model"})
        elif name not in required and not _takes_null(prop):  # its type moves into anyOf
            kept = {k: prop.pop(k) for k in list(prop)
                    if k not in ("default", "title", "description")}
            prop["anyOf"] = [kept, {"type": "null"}]


def _takes_null(prop: dict[str, Any]) -> bool:
    return prop.get("type") == "null" or any(
        _takes_null(p) for p in prop.get("anyOf", []) + prop.get("oneOf", []))
