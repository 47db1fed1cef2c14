"""The error bodies, the API-key check and the size limits every tidal HTTP app answers with:
the server and the P/D router install the same handlers, so a request one refuses the other
refuses alike."""

from __future__ import annotations

import hmac

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from tidal.server.config import HttpConfig
from tidal.server.limits import RequestLimits
from tidal.server.openai.protocol import APIError


def error_response(exc: APIError) -> JSONResponse:
    """An OpenAI-style error body with the error's status (and Retry-After on a 429)."""
    headers = {"Retry-After": str(exc.retry_after)} if exc.retry_after is not None else None
    return JSONResponse(exc.body(), status_code=exc.status, headers=headers)


async def _api_error(_: Request, exc: APIError) -> JSONResponse:
    return error_response(exc)


def _is_union_member(part) -> bool:
    """Whether a part of an error's loc names a union's member (str, list[int], a literal, a
    model class such as NamedToolChoice), not a field (fields are lower case)."""
    return isinstance(part, str) and (part in ("str", "int", "float", "bool", "none")
                                      or part.startswith(("list[", "dict[", "literal["))
                                      or part[:1].isupper())


async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
    errors = exc.errors()
    first = errors[0] if errors else {}
    if first.get("type") == "json_invalid":  # its loc is a character position, not a field
        why = (first.get("ctx") or {}).get("error", "invalid")
        return error_response(APIError(f"the body is not valid JSON: {why}"))
    # a union field fails once per member: the member that got furthest says most
    same = [e for e in errors if e["loc"][:2] == first.get("loc", ())[:2]]
    first = max(same, key=lambda e: len(e["loc"]), default=first)
    loc = [str(p) for p in first.get("loc", ())[1:] if not _is_union_member(p)]  # drop "body"
    ctx = first.get("ctx") or {}
    if first.get("type") == "refused":  # protocol.refuse: its own words, naming the field
        where = ".".join([*loc, ctx["param"]])
        return error_response(APIError(first["msg"], param=where))
    where = ".".join(loc) or None
    return error_response(APIError(f"{where or 'body'}: {first.get('msg', 'invalid')}",
                                   param=where))


async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
    return error_response(APIError(str(exc.detail), exc.status_code))


def install_error_handlers(app: FastAPI, http: HttpConfig) -> None:
    """Answer APIError, invalid bodies (400, not FastAPI's 422) and HTTP errors with OpenAI
    error bodies; with `http.api_key`, refuse /v1, /tokenize, /detokenize and /dashboard
    requests that do not carry it (401; the dashboard may carry it as `?api_key=`); refuse
    headers over `max_header_bytes` (431) and bodies over `max_body_bytes` (413)."""
    app.add_middleware(RequestLimits, max_body_bytes=http.max_body_bytes,
                       max_header_bytes=http.max_header_bytes)
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(RequestValidationError, _invalid)
    app.add_exception_handler(StarletteHTTPException, _http)

    api_key = http.api_key
    expected = f"Bearer {api_key}".encode()

    @app.middleware("http")
    async def _auth(request: Request, call_next):
        path = request.url.path
        page = path.startswith("/dashboard")
        if api_key and (path.startswith("/v1") or path in ("/tokenize", "/detokenize") or page):
            sent = request.headers.get("authorization", "").encode()
            if page and not sent:  # a browser cannot add headers to a page or EventSource
                sent = f"Bearer {request.query_params.get('api_key', '')}".encode()
            if not hmac.compare_digest(sent, expected):  # constant time: no timing oracle
                return error_response(APIError("invalid or missing API key", 401,
                                               "authentication_error"))
        return await call_next(request)
