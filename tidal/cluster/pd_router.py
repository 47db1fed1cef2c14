"""`tidal router`: the HTTP front of prefill/decode disaggregation.

For each OpenAI request it picks a decode instance (fewest requests in flight) and a prefill
instance (round robin), and forwards the request to the decode instance with
`kv_transfer_params.prefill_address` set to the prefill core's KV socket. The decode instance
allocates the blocks, asks that prefill core for the prompt's KV, decodes, and streams back
through here. Backpressure lives in the decode instance's admission queue: a request with no
room waits there, and its prompt is not computed until it has blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from contextlib import asynccontextmanager

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from tidal.cluster.routing import CoreLoad, Router
from tidal.server.protocol import APIError

log = logging.getLogger("tidal.router")


class Instance:
    """One `tidal serve --role ...` the router forwards to."""

    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")
        self.kv_address = ""
        self.in_flight = 0


class PDRouter:
    def __init__(self, prefill: list[str], decode: list[str]) -> None:
        if not prefill or not decode:
            raise ValueError("the router needs at least one prefill and one decode instance")
        self.prefill = [Instance(u) for u in prefill]
        self.decode = [Instance(u) for u in decode]
        self._prefill_router = Router("round_robin", len(self.prefill))
        self._decode_router = Router("least_tokens", len(self.decode))
        self.http = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=5.0))

    async def wait_ready(self, timeout: float = 600.0) -> None:
        """Wait for every instance's /health; check its role; learn the prefill cores'
        KV addresses."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        for role, group in (("prefill", self.prefill), ("decode", self.decode)):
            for inst in group:
                while True:
                    with contextlib.suppress(httpx.HTTPError):
                        r = await self.http.get(inst.url + "/health")
                        if r.status_code == 200:
                            break
                    if loop.time() > deadline:
                        raise RuntimeError(f"{inst.url} did not become healthy")
                    await asyncio.sleep(0.3)
                health = r.json()
                if health.get("role") != role:
                    raise RuntimeError(f"{inst.url} serves role {health.get('role')!r}, "
                                       f"not {role!r}")
                inst.kv_address = health.get("kv_address", "")

    def pick(self) -> tuple[Instance, Instance]:
        d = self.decode[self._decode_router.choose([CoreLoad(i.in_flight)
                                                    for i in self.decode])]
        p = self.prefill[self._prefill_router.choose([CoreLoad() for _ in self.prefill])]
        return p, d

    async def forward(self, path: str, request: Request) -> Response:
        try:
            body = await request.json()
        except ValueError:
            return _error("the body is not valid JSON", 400)
        if not isinstance(body, dict):
            return _error("the body must be a JSON object", 400)
        if body.get("n", 1) != 1:
            return _error("n > 1 is not supported with prefill/decode disaggregation", 400,
                          param="n")
        p, d = self.pick()
        body["kv_transfer_params"] = {"prefill_address": p.kv_address}
        headers = {k: v for k, v in request.headers.items()
                   if k.lower() in ("authorization", "content-type")}
        d.in_flight += 1
        try:
            upstream = await self.http.send(
                self.http.build_request("POST", d.url + path, json=body, headers=headers),
                stream=True)
        except httpx.HTTPError as exc:
            d.in_flight -= 1
            return _error(f"decode instance {d.url} unreachable: {exc}", 503,
                          "service_unavailable")
        if not body.get("stream") or upstream.status_code != 200:
            try:
                content = await upstream.aread()
            except httpx.HTTPError as exc:
                return _error(f"decode instance {d.url} failed mid-request: {exc}", 503,
                              "service_unavailable")
            finally:
                d.in_flight -= 1
                await upstream.aclose()
            return Response(content, upstream.status_code,
                            media_type=upstream.headers.get("content-type"))

        async def relay():
            try:
                async for chunk in upstream.aiter_raw():
                    yield chunk
            except httpx.HTTPError as exc:  # the decode instance died mid-stream
                err = APIError(f"decode instance {d.url} failed mid-stream: {exc}", 503,
                               "service_unavailable")
                yield f"data: {json.dumps(err.body())}\n\ndata: [DONE]\n\n".encode()
            finally:
                d.in_flight -= 1
                await upstream.aclose()  # a client that left closes the decode side too

        return StreamingResponse(relay(), media_type="text/event-stream")


def _error(message: str, status: int, kind: str = "invalid_request_error",
           param: str | None = None) -> JSONResponse:
    return JSONResponse(APIError(message, status, kind, param).body(), status_code=status)


def build_router_app(router: PDRouter, on_shutdown=None) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await router.wait_ready()
        log.info("router ready: prefill %s, decode %s", [i.url for i in router.prefill],
                 [i.url for i in router.decode])
        yield
        await router.http.aclose()
        if on_shutdown is not None:
            on_shutdown()

    app = FastAPI(title="tidal router", lifespan=lifespan)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await router.forward("/v1/completions", request)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await router.forward("/v1/chat/completions", request)

    @app.get("/v1/models")
    async def models(request: Request):
        try:
            r = await router.http.get(router.decode[0].url + "/v1/models",
                                      headers={k: v for k, v in request.headers.items()
                                               if k.lower() == "authorization"})
        except httpx.HTTPError as exc:
            return _error(f"decode instance unreachable: {exc}", 503, "service_unavailable")
        return Response(r.content, r.status_code, media_type="application/json")

    @app.get("/health")
    async def health():
        down = []
        for inst in router.prefill + router.decode:
            try:
                ok = (await router.http.get(inst.url + "/health")).status_code == 200
            except httpx.HTTPError:
                ok = False
            if not ok:
                down.append(inst.url)
        if down:
            return _error(f"instances down: {', '.join(down)}", 503, "service_unavailable")
        return {"status": "ok", "prefill": [i.url for i in router.prefill],
                "decode": [i.url for i in router.decode]}

    return app
