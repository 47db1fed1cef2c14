"""What a public endpoint refuses before a request reaches a route: headers and bodies over a
size (431, 413: an ASGI middleware every tidal HTTP app installs, beside uvicorn's h11 limit
on headers still arriving), and connections idle too long, too slow to send a request or
past the connection cap (`uvicorn_limits`); and where it listens, how (TLS) and what it logs
(`uvicorn_options`)."""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import time
from typing import Callable

import h11
import uvicorn
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException
from uvicorn.protocols.http.h11_impl import H11Protocol

from tidal.server.config import HttpConfig
from tidal.server.anthropic.protocol import body_for
from tidal.server.openai.protocol import APIError


def route_path(scope) -> str:
    """The request's path as the routes see it: without the proxy's prefix (HttpConfig.
    root_path) where the path still carries it, so checks by path match either way."""
    path, root = scope["path"], scope.get("root_path", "")
    if root and (path == root or path.startswith(root + "/")):
        return path[len(root):] or "/"
    return path


class _TooLarge(HTTPException):
    """Raised from `receive` inside a route: FastAPI re-raises HTTPExceptions it meets while
    reading the body, and the app's handler answers them with an OpenAI error body."""


def _refusal(message: str, status: int, path: str) -> JSONResponse:
    return JSONResponse(body_for(APIError(message, status), path), status)


class RequestLimits:
    """ASGI middleware: 431 for a request line plus headers over `max_header_bytes` (h11
    refuses them too, but only while they are still arriving); 413 for a body over
    `max_body_bytes` (`uploads`: path -> its own limit), by its Content-Length before
    anything is read, or counted as a chunked body arrives."""

    def __init__(self, app, max_body_bytes: int, max_header_bytes: int,
                 uploads: dict[str, int] | None = None) -> None:
        self.app, self.max_body, self.max_header = app, max_body_bytes, max_header_bytes
        self.uploads = uploads or {}

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = route_path(scope)
        query = scope.get("query_string") or b""
        target = len(scope.get("raw_path") or b"") + (len(query) + 1 if query else 0)
        head = len(scope["method"]) + target + 12  # "GET /path HTTP/1.1\r\n"
        head += sum(len(k) + len(v) + 4 for k, v in scope["headers"]) + 2  # "k: v\r\n", "\r\n"
        if head > self.max_header:
            await _refusal(f"the request line and headers are over this server's limit of "
                           f"{self.max_header} bytes", 431, path)(scope, receive, send)
            return
        most = self.uploads.get(path, self.max_body)
        message = f"the request body is over this server's limit of {most} bytes"
        length = dict(scope["headers"]).get(b"content-length", b"")
        if length.isdigit() and int(length) > most:
            await _refusal(message, 413, path)(scope, receive, send)
            return
        seen, started = 0, False

        async def counted():
            nonlocal seen
            event = await receive()
            if event["type"] == "http.request":
                seen += len(event.get("body", b""))
                if seen > most:
                    raise _TooLarge(413, message)
            return event

        async def watched(event) -> None:
            nonlocal started
            started = started or event["type"] == "http.response.start"
            await send(event)

        try:
            await self.app(scope, counted, watched)
        except _TooLarge:  # read outside a route (a middleware): answer here
            if started:
                raise
            await _refusal(message, 413, path)(scope, receive, send)


class IdleH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with three more limits: its keep-alive timer also runs from
    the moment a connection opens (one that never sends a request is closed like an idle
    kept-alive one); a request must arrive whole, headers and body, within `read_timeout`
    of its first byte (a client trickling bytes is closed); and past `max_connections`
    open ones a new connection is closed at once, so descriptors never run out. Each
    closes quietly: a flood of them writes no flood of log lines."""

    read_timeout = 30.0
    max_connections = 65536

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.read_deadline: asyncio.TimerHandle | None = None
        if len(self.connections) > self.max_connections:
            transport.abort()  # connection_lost then forgets it
            return
        self.timeout_keep_alive_task = self.loop.call_later(
            self.timeout_keep_alive, self.timeout_keep_alive_handler)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state in (h11.IDLE, h11.SEND_BODY):  # a request partly here
            if self.read_deadline is None:
                self.read_deadline = self.loop.call_later(self.read_timeout,
                                                          self.transport.close)
        else:  # whole (or the connection is ending): the next request gets its own time
            self._disarm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def on_response_complete(self) -> None:
        self._disarm()
        super().on_response_complete()

    def _disarm(self) -> None:
        if self.read_deadline is not None:
            self.read_deadline.cancel()
            self.read_deadline = None


class AcceptErrorsOnceInAWhile(logging.Filter):
    """asyncio logs "socket.accept() out of system resource", with a traceback, once for
    every connection of a burst it cannot accept (up to its backlog of 2,048 in a row): a
    burst past the open-file limit, before the connection cap closes the surplus, flooded
    the log. One line every `every` seconds says it, and how many were left out."""

    MESSAGE = "socket.accept() out of system resource"

    def __init__(self, every: float = 10.0) -> None:
        super().__init__()
        self.every, self.last, self.dropped = every, -float("inf"), 0

    def filter(self, record: logging.LogRecord) -> bool:
        if not record.getMessage().startswith(self.MESSAGE):
            return True
        now = time.monotonic()
        if now - self.last < self.every:
            self.dropped += 1
            return False
        more = f" ({self.dropped} more since the last)" if self.dropped else ""
        record.msg, record.args, record.exc_info = (
            f"{self.MESSAGE}: too many open files; connections wait in the listen queue"
            f"{more}", (), None)
        self.last, self.dropped = now, 0
        return True


def install_accept_error_filter() -> None:
    """Put AcceptErrorsOnceInAWhile on asyncio's logger (once per process)."""
    aio = logging.getLogger("asyncio")
    if not any(isinstance(f, AcceptErrorsOnceInAWhile) for f in aio.filters):
        aio.addFilter(AcceptErrorsOnceInAWhile())


def uvicorn_limits(http: HttpConfig) -> dict:
    """uvicorn.run's arguments for the header size limit, the idle and read timeouts and the
    connection cap (h11 is the parser that enforces the header limit, whether or not
    httptools is installed)."""
    install_accept_error_filter()
    protocol = type("LimitedH11Protocol", (IdleH11Protocol,),
                    {"read_timeout": http.request_read_timeout,
                     "max_connections": http.connection_cap()})
    return {"http": protocol, "h11_max_incomplete_event_size": http.max_header_bytes,
            "timeout_keep_alive": http.idle_timeout}


def uvicorn_options(http: HttpConfig) -> dict:
    """All of uvicorn.run's arguments but the app: host:port or the Unix socket, TLS, the
    log level and access log, and the limits (the proxy's prefix is the app's own:
    uvicorn's would prefix every path once more)."""
    where = {"uds": http.uds} if http.uds is not None else {"host": http.host,
                                                             "port": http.port}
    tls = {k: getattr(http, k) for k in ("ssl_keyfile", "ssl_certfile", "ssl_ca_certs")
           if getattr(http, k) is not None}
    if tls:
        tls["ssl_cert_reqs"] = http.ssl_cert_reqs
    return {**where, **tls, "log_level": http.uvicorn_log_level,
            "access_log": not http.disable_uvicorn_access_log, **uvicorn_limits(http)}


class _Server(uvicorn.Server):
    """uvicorn's server, calling `on_exit` as a stop signal arrives, before its drain."""

    def __init__(self, config: uvicorn.Config, on_exit: Callable[[], None]) -> None:
        super().__init__(config)
        self.on_exit = on_exit

    def handle_exit(self, sig, frame) -> None:
        self.on_exit()
        super().handle_exit(sig, frame)


def run_server(app, http: HttpConfig, on_exit: Callable[[], None], **options) -> None:
    """uvicorn.run in one process over `http`'s options (and `options`), with `on_exit`
    told of SIGTERM or SIGINT before the connections drain."""
    config = uvicorn.Config(app, **uvicorn_options(http), **options)
    server = _Server(config, on_exit)
    try:
        server.run()
    except KeyboardInterrupt:
        pass
    finally:
        if config.uds and os.path.exists(config.uds):
            os.remove(config.uds)
    if not server.started:
        sys.exit(3)  # uvicorn's exit status for a server that never started
