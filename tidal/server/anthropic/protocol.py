"""What the Anthropic Messages routes share with the rest of the server: their paths, and
their error body (`{"type": "error", "error": {"type", "message"}}`, Anthropic's error
types by status) for every refusal the server makes on them."""

from __future__ import annotations

from tidal.server.openai.protocol import APIError

PREFIX = "/v1/messages"  # the routes whose errors take Anthropic's shape

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
          503: "overloaded_error", 529: "overloaded_error"}


def error_body(exc: APIError) -> dict:
    """The error as Anthropic writes it: no `param`, so the message names the field at
    fault."""
    kind = _TYPES.get(exc.status, "api_error" if exc.status >= 500 else
                      "invalid_request_error")
    message = exc.message if not exc.param or exc.param in exc.message \
        else f"{exc.param}: {exc.message}"
    return {"type": "error", "error": {"type": kind, "message": message}}


def body_for(exc: APIError, path: str) -> dict:
    """The error body a request to `path` gets: Anthropic's on the Messages routes, else
    OpenAI's."""
    return error_body(exc) if path.startswith(PREFIX) else exc.body()
