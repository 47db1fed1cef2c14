"""The error bodies and the API-key check every tidal HTTP app answers with: the server and
the P/D router install the same handlers, so a request one refuses the other refuses alike."""

from __future__ import annotations

import hmac

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from tidal.server.protocol import APIError


def error_response(exc: APIError) -> JSONResponse:
    """An OpenAI-style error body with the error's status (and Retry-After on a 429)."""
    headers = {"Retry-After": str(exc.retry_after)} if exc.retry_after is not None else None
    return JSONResponse(exc.body(), status_code=exc.status, headers=headers)


async def _api_error(_: Request, exc: APIError) -> JSONResponse:
    return error_response(exc)


async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
    errors = exc.errors()
    first = errors[0] if errors else {}
    loc = [str(p) for p in first.get("loc", ())[1:]]  # drop the "body" root
    ctx = first.get("ctx") or {}
    if first.get("type") == "refused":  # protocol.refuse: its own words, naming the field
        where = ".".join([*loc, ctx["param"]])
        return error_response(APIError(first["msg"], param=where))
    where = ".".join(loc) or None
    return error_response(APIError(f"{where or 'body'}: {first.get('msg', 'invalid')}",
                                   param=where))


async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
    return error_response(APIError(str(exc.detail), exc.status_code))


def install_error_handlers(app: FastAPI, api_key: str | None) -> None:
    """Answer APIError, invalid bodies (400, not FastAPI's 422) and HTTP errors with OpenAI
    error bodies; with `api_key`, refuse /v1, /tokenize and /detokenize requests that do not
    carry it (401)."""
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(RequestValidationError, _invalid)
    app.add_exception_handler(StarletteHTTPException, _http)

    expected = f"Bearer {api_key}".encode()

    @app.middleware("http")
    async def _auth(request: Request, call_next):
        path = request.url.path
        if api_key and (path.startswith("/v1") or path in ("/tokenize", "/detokenize")):
            sent = request.headers.get("authorization", "").encode()
            if not hmac.compare_digest(sent, expected):  # constant time: no timing oracle
                return error_response(APIError("invalid or missing API key", 401,
                                               "authentication_error"))
        return await call_next(request)
