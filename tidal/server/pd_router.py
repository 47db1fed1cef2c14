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
from typing import Annotated

import httpx
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import Response, StreamingResponse

from tidal.cluster.routing import CoreLoad, Router
from tidal.server.errors import install_error_handlers
from tidal.server.protocol import APIError, ChatRequest, CompletionRequest, GenerationRequest

log = logging.getLogger("tidal.router")


class Instance:
    """One `tidal serve --role ...` the router forwards to."""

    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")
        self.kv_address = ""
        self.in_flight = 0


class PDRouter:
    """The prefill and decode instances, how to pick a pair, and the forwarding itself."""

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

    async def forward(self, path: str, body: GenerationRequest, request: Request) -> Response:
        """Send a request the server's own models accepted to a decode instance, naming the
        prefill core; relay its answer (streamed or not) as it comes."""
        body.check_disaggregated()
        raw = await request.json()  # as the client sent it (FastAPI parsed and kept it)
        p, d = self.pick()
        raw["kv_transfer_params"] = {"prefill_address": p.kv_address}
        headers = _auth_header(request)  # httpx writes the JSON content type
        d.in_flight += 1
        try:
            upstream = await self.http.send(
                self.http.build_request("POST", d.url + path, json=raw, headers=headers),
                stream=True)
        except httpx.HTTPError as exc:
            d.in_flight -= 1
            raise APIError(f"decode instance {d.url} unreachable: {exc}", 503,
                           "service_unavailable") from exc
        if not body.stream or upstream.status_code != 200:
            try:
                content = await upstream.aread()
            except httpx.HTTPError as exc:
                raise APIError(f"decode instance {d.url} failed mid-request: {exc}", 503,
                               "service_unavailable") from exc
            finally:
                d.in_flight -= 1
                await upstream.aclose()
            retry = upstream.headers.get("retry-after")  # a decode instance's 429
            return Response(content, upstream.status_code,
                            media_type=upstream.headers.get("content-type"),
                            headers={"Retry-After": retry} if retry else None)

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

    async def models(self, request: Request) -> Response:
        """The first decode instance's /v1/models."""
        try:
            r = await self.http.get(self.decode[0].url + "/v1/models",
                                    headers=_auth_header(request))
        except httpx.HTTPError as exc:
            raise APIError(f"decode instance unreachable: {exc}", 503,
                           "service_unavailable") from exc
        return Response(r.content, r.status_code, media_type="application/json")

    async def health(self) -> dict:
        """ok when every instance answers its /health with 200."""
        down = []
        for inst in self.prefill + self.decode:
            try:
                ok = (await self.http.get(inst.url + "/health")).status_code == 200
            except httpx.HTTPError:
                ok = False
            if not ok:
                down.append(inst.url)
        if down:
            raise APIError(f"instances down: {', '.join(down)}", 503, "service_unavailable")
        return {"status": "ok", "prefill": [i.url for i in self.prefill],
                "decode": [i.url for i in self.decode]}


def _auth_header(request: Request) -> dict[str, str]:
    """The client's Authorization header, for the instance a request is passed to."""
    key = request.headers.get("authorization")
    return {"authorization": key} if key is not None else {}


def get_router(request: Request) -> PDRouter:
    return request.app.state.router


RouterDep = Annotated[PDRouter, Depends(get_router)]
routes = APIRouter()


# The bodies are parsed with the server's own models: a request the server refuses is
# refused here with the same 400, before it costs a prefill.
@routes.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request, router: RouterDep):
    return await router.forward("/v1/completions", body, request)


@routes.post("/v1/chat/completions")
async def chat(body: ChatRequest, request: Request, router: RouterDep):
    return await router.forward("/v1/chat/completions", body, request)


@routes.get("/v1/models")
async def models(request: Request, router: RouterDep):
    return await router.models(request)


@routes.get("/health")
async def health(router: RouterDep):
    return await router.health()


def build_router_app(router: PDRouter, on_shutdown=None, api_key: str | None = None
                     ) -> FastAPI:
    """The router's app; `on_shutdown` runs after it stops (`--pd` stops its instances).
    With `api_key` it checks keys itself, so a refusal comes in the server's order."""

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
    app.state.router = router
    install_error_handlers(app, api_key)
    app.include_router(routes)
    return app
