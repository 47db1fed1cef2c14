"""The error bodies, the API-key check and the size limits every tidal HTTP app answers with:
the server and the P/D router install the same handlers, so a request one refuses the other
refuses alike."""

from __future__ import annotations

import hmac
import logging
import re
import uuid
from urllib.parse import urlencode

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import HTMLResponse, JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from tidal.server.anthropic.protocol import body_for
from tidal.server.config import HttpConfig
from tidal.server.limits import RequestLimits, route_path
from tidal.server.openai.protocol import APIError


def error_response(exc: APIError, request: Request | None = None) -> JSONResponse:
    """An OpenAI-style error body (Anthropic's on its Messages routes) with the error's
    status (and Retry-After on a 429)."""
    headers = {"Retry-After": str(exc.retry_after)} if exc.retry_after is not None else None
    body = body_for(exc, route_path(request.scope)) if request is not None else exc.body()
    return JSONResponse(body, status_code=exc.status, headers=headers)


async def _api_error(request: Request, exc: APIError) -> JSONResponse:
    return error_response(exc, request)


def _is_union_member(part) -> bool:
    """Whether a part of an error's loc names a union's member (str, list[int], a literal, a
    model class such as NamedToolChoice), not a field (fields are lower case)."""
    return isinstance(part, str) and (part in ("str", "int", "float", "bool", "none")
                                      or part.startswith(("list[", "dict[", "literal[",
                                                          "constrained-"))
                                      or part[:1].isupper())


async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
    errors = exc.errors()
    first = errors[0] if errors else {}
    if first.get("type") == "json_invalid":  # its loc is a character position, not a field
        why = (first.get("ctx") or {}).get("error", "invalid")
        return error_response(APIError(f"the body is not valid JSON: {why}"), request)
    # a union field fails once per member: the member that got furthest says most, and
    # of those one whose type matched (a list too short, not "should be a valid string")
    same = [e for e in errors if e["loc"][:2] == first.get("loc", ())[:2]]
    first = max(same, key=lambda e: (len(e["loc"]), not e["type"].endswith("_type")),
                default=first)
    loc = [str(p) for p in first.get("loc", ())[1:] if not _is_union_member(p)]  # drop "body"
    ctx = first.get("ctx") or {}
    if first.get("type") == "refused":  # protocol.refuse: its own words, naming the field
        where = ".".join([*loc, ctx["param"]])
        return error_response(APIError(first["msg"], param=where), request)
    where = ".".join(loc) or None
    return error_response(APIError(f"{where or 'body'}: {first.get('msg', 'invalid')}",
                                   param=where), request)


async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    response = error_response(APIError(str(exc.detail), exc.status_code), request)
    response.headers.update(exc.headers or {})
    if exc.status_code == 405:  # Starlette's Allow names the first route of the path only
        response.headers["Allow"] = ", ".join(
            m for m in ("DELETE", "GET", "HEAD", "OPTIONS", "PATCH", "POST", "PUT")
            if any(route.matches({**request.scope, "method": m})[0] == Match.FULL
                   for route in request.app.router.routes))
    return response


def install_error_handlers(app: FastAPI, http: HttpConfig,
                           uploads: dict[str, int] | None = None) -> None:
    """Answer APIError, invalid bodies (400, not FastAPI's 422) and HTTP errors with OpenAI
    error bodies (Anthropic's on its routes); with an API key (`http.key`), refuse /v1, /v2,
    the `UNVERSIONED` routes, /dashboard and the docs requests that do not carry it (401;
    pages may carry it as `?api_key=`, which the access log redacts); refuse headers over
    `max_header_bytes` (431) and bodies over `max_body_bytes` (413), or over their own
    limit on the `uploads` paths; serve under the proxy's `root_path`; answer browsers of
    `allowed_origins` (CORS)."""
    app.add_middleware(RequestLimits, max_body_bytes=http.max_body_bytes,
                       max_header_bytes=http.max_header_bytes, uploads=uploads or {})
    app.add_middleware(RequestIds)
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(RequestValidationError, _invalid)
    app.add_exception_handler(StarletteHTTPException, _http)

    api_key = http.key
    expected = f"Bearer {api_key}".encode()
    install_key_redaction()

    @app.middleware("http")
    async def _auth(request: Request, call_next):
        path = route_path(request.scope)  # a path the proxy did not strip is checked alike
        page = path.startswith("/dashboard") or path in DOC_PAGES
        if api_key and (path.startswith(("/v1", "/v2")) or path in UNVERSIONED or page):
            if not authorized(request, expected, page):
                return error_response(APIError("invalid or missing API key", 401,
                                               "authentication_error"), request)
        return await call_next(request)

    app.root_path = http.root_path or ""  # routes match with or without the prefix
    if http.allowed_origins:  # outermost: a preflight is answered before the key is asked
        app.add_middleware(CORSMiddleware, allow_origins=list(http.allowed_origins),
                           allow_methods=list(http.allowed_methods),
                           allow_headers=list(http.allowed_headers),
                           allow_credentials=http.allow_credentials)


class RequestIds:
    """Every HTTP answer carries X-Request-Id: the one the client sent (its first 128
    characters), else a new one, so a client's logs and the server's can be matched."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        sent = next((v for k, v in scope["headers"] if k == b"x-request-id"), b"")[:128]
        rid = sent or uuid.uuid4().hex.encode()

        async def with_id(message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", ()), (b"x-request-id", rid)]
            await send(message)

        await self.app(scope, receive, with_id)


# API routes outside /v1 (vLLM's, llama.cpp's): behind the key as /v1 is
UNVERSIONED = ("/tokenize", "/detokenize", "/score", "/rerank", "/classify",
               "/reset_prefix_cache", "/flush_cache", "/generate", "/encode",
               "/get_model_info", "/get_server_info", "/abort_request", "/pause", "/resume",
               "/is_paused", "/pause_generation", "/continue_generation",
               "/update_weights_from_disk", "/get_weight_version", "/sleep", "/wake_up",
               "/is_sleeping", "/release_memory_occupation", "/resume_memory_occupation",
               "/start_profile", "/stop_profile", "/invocations", "/load", "/get_load")
# The API's schema and its two documentation pages: behind the key when there is one (they
# list every route and field), and, as pages, with the key also as ?api_key=.
DOC_PAGES = ("/openapi.json", "/docs", "/redoc")


def authorized(request: Request, expected: bytes, page: bool = False) -> bool:
    """Whether the request carries the key (`expected`: b"Bearer KEY") as a bearer token or
    as `x-api-key` (Anthropic's clients); a page may carry it as ?api_key=, since a browser
    cannot add headers to a page or an EventSource."""
    sent = request.headers.get("authorization", "").encode()
    if not sent and "x-api-key" in request.headers:
        sent = f"Bearer {request.headers['x-api-key']}".encode()
    if page and not sent:
        sent = f"Bearer {request.query_params.get('api_key', '')}".encode()
    return hmac.compare_digest(sent, expected)  # constant time: no timing oracle


class _RedactKeys(logging.Filter):
    """Access-log lines with ?api_key=... (a dashboard's URL) print the key as [redacted]."""

    PATTERN = re.compile(r"(api_key=)[^&\s]*")

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple):
            record.args = tuple(self.PATTERN.sub(r"\1[redacted]", a) if isinstance(a, str)
                                else a for a in record.args)
        return True


def install_docs(app: FastAPI) -> None:
    """/docs and /redoc (the app made with docs_url=None, redoc_url=None): FastAPI's pages,
    whose schema URL carries the page's own ?api_key= so that a keyed server's page loads."""

    def schema_url(request: Request) -> str:
        key = request.query_params.get("api_key")
        prefix = request.scope.get("root_path", "").rstrip("/")  # behind a path proxy
        return prefix + app.openapi_url + (f"?{urlencode({'api_key': key})}" if key else "")

    @app.get("/docs", include_in_schema=False)
    async def swagger(request: Request) -> HTMLResponse:
        return get_swagger_ui_html(openapi_url=schema_url(request), title=f"{app.title} docs")

    @app.get("/redoc", include_in_schema=False)
    async def redoc(request: Request) -> HTMLResponse:
        return get_redoc_html(openapi_url=schema_url(request), title=f"{app.title} docs")


def install_key_redaction() -> None:
    access = logging.getLogger("uvicorn.access")
    if not any(isinstance(f, _RedactKeys) for f in access.filters):
        access.addFilter(_RedactKeys())
