"""`tidal router`: the HTTP front of prefill/decode disaggregation.

For each generation request (OpenAI's completions, chat and Responses, Anthropic's Messages)
it picks a decode instance (fewest requests in flight) and a prefill instance (round robin),
and forwards the request to the decode instance with
`kv_transfer_params.prefill_address` set to the prefill core's KV socket. The decode instance
allocates the blocks, asks that prefill core for the prompt's KV, decodes, and streams back
through here. Backpressure lives in the decode instance's admission queue: a request with no
room waits there, and its prompt is not computed until it has blocks. A Responses request
that continues a stored one goes to the decode instance that stored it (each keeps its
own). Embeddings and scores end at their prompts: a prefill instance computes them.

The router re-reads every instance's /health each `health_interval` seconds, and at once
after a failed forward: an instance that fails it leaves the rotation until it passes again,
and a prefill instance whose core was restarted is sent to at its new KV address.

Its /dashboard shows every instance's cores: its stream merges the instances' streams.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from contextlib import asynccontextmanager
from typing import Annotated, AsyncIterator
from urllib.parse import quote

import httpx
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import HTMLResponse, Response, StreamingResponse

from tidal.cluster.routing import CoreLoad, Router
from tidal.server.config import HttpConfig
from tidal.server.dashboard import favicon, page_html
from tidal.server.errors import install_docs, install_error_handlers
from tidal.server.openapi import install_schema
from tidal.server.openai.chat import ChatRequest, TokenizeRequest
from tidal.server.anthropic.protocol import body_for
from tidal.server.anthropic.request import MessagesRequest
from tidal.server.openai.embeddings import EmbeddingRequest
from tidal.server.openai.protocol import APIError, CompletionRequest, DetokenizeRequest
from tidal.server.responses.request import ResponsesRequest
from tidal.server.responses.routes import not_stored
from tidal.server.scoring import ClassifyRequest, RerankRequest, ScoreRequest
from tidal.server.sglang.request import (AbortRequest, EncodeRequest, GenerateRequest,
                                         in_sglang_terms)

log = logging.getLogger("tidal.router")


class Instance:
    """One `tidal serve --role ...` the router forwards to."""

    def __init__(self, url: str, role: str) -> None:
        self.url, self.role = url.rstrip("/"), role
        self.kv_address = ""
        self.in_flight = 0
        self.healthy = True


class PDRouter:
    """The prefill and decode instances, how to pick a pair, and the forwarding itself."""

    def __init__(self, prefill: list[str], decode: list[str],
                 health_interval: float = 1.0) -> None:
        if not prefill or not decode:
            raise ValueError("the router needs at least one prefill and one decode instance")
        self.prefill = [Instance(u, "prefill") for u in prefill]
        self.decode = [Instance(u, "decode") for u in decode]
        self.health_interval = health_interval
        self._recheck = asyncio.Event()
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

    async def check(self, inst: Instance) -> None:
        """Re-read `inst`'s /health: in rotation while it answers 200 in its role."""
        try:
            r = await self.http.get(inst.url + "/health", timeout=5.0)
            health = r.json() if r.status_code == 200 else {}
        except (httpx.HTTPError, ValueError):
            health = {}
        healthy = health.get("role") == inst.role
        if healthy:
            inst.kv_address = health.get("kv_address", "")
        if healthy != inst.healthy:
            log.warning("%s instance %s is %s", inst.role, inst.url,
                        "back in rotation" if healthy else "out of rotation")
        inst.healthy = healthy

    async def watch_health(self) -> None:
        """Check every instance each `health_interval` s, or at once when asked to."""
        while True:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._recheck.wait(), self.health_interval)
            self._recheck.clear()
            await asyncio.gather(*(self.check(i) for i in self.prefill + self.decode))

    def pick(self, role: str) -> Instance:
        """A healthy instance of `role`: a decode one with the fewest requests in flight, a
        prefill one round robin."""
        group, router = ((self.decode, self._decode_router) if role == "decode"
                         else (self.prefill, self._prefill_router))
        if not any(i.healthy for i in group):
            raise APIError(f"no {role} instance is healthy; retry later", 503,
                           "service_unavailable", retry_after=1)
        return group[router.choose([CoreLoad(i.in_flight, available=i.healthy)
                                    for i in group])]

    async def forward(self, path: str, stream: bool, request: Request,
                      decode: Instance | None = None) -> Response:
        """Send a request the server's own models accepted to a decode instance (`decode`,
        else the least busy), naming the prefill core; relay its answer (streamed or not)
        as it comes."""
        raw = await request.json()  # as the client sent it (FastAPI parsed and kept it)
        p = self.pick("prefill")
        d = decode or self.pick("decode")
        raw["kv_transfer_params"] = {"prefill_address": p.kv_address}
        headers = _auth_header(request)  # httpx writes the JSON content type
        d.in_flight += 1
        try:
            upstream = await self.http.send(
                self.http.build_request("POST", d.url + path, json=raw, headers=headers),
                stream=True)
        except httpx.HTTPError as exc:
            d.in_flight -= 1
            d.healthy = False  # until its /health says otherwise
            self._recheck.set()
            raise APIError(f"decode instance {d.url} unreachable: {exc}", 503,
                           "service_unavailable") from exc
        if upstream.status_code >= 500:  # an instance's core died or restarts: look again
            self._recheck.set()
        if not stream or upstream.status_code != 200:
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
                self._recheck.set()
                err = APIError(f"decode instance {d.url} failed mid-stream: {exc}", 503,
                               "service_unavailable")
                body = json.dumps(body_for(err, path))
                yield (f"event: error\ndata: {body}\n\n" if path == "/v1/messages"
                       else f"data: {body}\n\ndata: [DONE]\n\n").encode()
            finally:
                d.in_flight -= 1
                await upstream.aclose()  # a client that left closes the decode side too

        return StreamingResponse(relay(), media_type="text/event-stream")

    async def relay(self, path: str, request: Request, inst: Instance | None = None,
                    ) -> Response:
        """`inst`'s answer (default: a healthy decode instance's) to a request that needs no
        KV moved (/v1/models, /tokenize, /detokenize: every instance serves the same model
        and tokenizer)."""
        inst = inst or next((d for d in self.decode if d.healthy), self.decode[0])
        headers = {**_auth_header(request), "content-type": "application/json"}
        try:
            r = await self.http.request(request.method, inst.url + path, headers=headers,
                                        params=[(k, v) for k, v in request.query_params
                                                .multi_items() if k != "api_key"],
                                        content=await request.body())
        except httpx.HTTPError as exc:
            raise APIError(f"{inst.role} instance unreachable: {exc}", 503,
                           "service_unavailable") from exc
        return Response(r.content, r.status_code, media_type="application/json")

    async def to_all(self, path: str, request: Request) -> Response:
        """Every instance's answer to the same request (/reset_prefix_cache): the first
        failure's, else the last one's. A pause or a weight update reaches the decode
        instances first (where requests enter), a resume the prefill ones (which compute
        what they wait for)."""
        first = path in _DECODE_FIRST
        order = self.decode + self.prefill if first else self.prefill + self.decode
        answers = [await self.relay(path, request, inst) for inst in order]
        return next((a for a in answers if a.status_code != 200), answers[-1])

    async def to_prefill(self, path: str, request: Request) -> Response:
        """A prefill instance's answer (round robin) to a request that ends at its prompt:
        embeddings and scores are computed where prompts are, beside no decode."""
        return await self.relay(path, request, self.pick("prefill"))

    async def holder(self, response_id: str, request: Request) -> Instance | None:
        """The decode instance whose store holds a response (each keeps those it made)."""
        for inst in (d for d in self.decode if d.healthy):
            with contextlib.suppress(httpx.HTTPError):
                r = await self.http.get(f"{inst.url}/v1/responses/{quote(response_id, safe='')}",
                                        headers=_auth_header(request))
                if r.status_code == 200:
                    return inst
        return None

    async def dashboard_events(self, auth: dict[str, str]) -> AsyncIterator[str]:
        """The instances' dashboard streams as one: the i-th instance (prefill ones first)
        has its core c shown as core 1000 i + c, labelled with its role and address."""
        events: asyncio.Queue = asyncio.Queue(64)

        async def follow(i: int, inst: Instance) -> None:
            while True:  # an instance that restarts or drops the stream is followed again
                with contextlib.suppress(httpx.HTTPError):
                    async with self.http.stream("GET", inst.url + "/dashboard/stream",
                                                headers=auth) as r:
                        async for line in r.aiter_lines():
                            if line.startswith("data: "):
                                event = json.loads(line[len("data: "):])
                                core = event["core"]
                                event.update(core=1000 * i + core,
                                             label=f"{inst.role} {inst.url}, core {core}")
                                if events.full():  # a slow page drops its oldest event
                                    events.get_nowait()
                                events.put_nowait(f"data: {json.dumps(event)}\n\n")
                await asyncio.sleep(1.0)

        tasks = [asyncio.create_task(follow(i, inst))
                 for i, inst in enumerate(self.prefill + self.decode)]
        try:
            yield ": tidal router dashboard\n\n"
            while True:
                yield await events.get()
        finally:
            for t in tasks:
                t.cancel()

    async def health(self) -> dict:
        """ok when every instance answers its /health with 200 (checked now, which also
        updates the rotation)."""
        await asyncio.gather(*(self.check(i) for i in self.prefill + self.decode))
        down = [i.url for i in self.prefill + self.decode if not i.healthy]
        if down:
            raise APIError(f"instances down: {', '.join(down)}", 503, "service_unavailable")
        return {"status": "ok", "prefill": [i.url for i in self.prefill],
                "decode": [i.url for i in self.decode]}


def _auth_header(request: Request) -> dict[str, str]:
    """The client's Authorization header (or Anthropic's x-api-key, or a dashboard's
    ?api_key=), for the instance a request is passed to."""
    key = request.headers.get("authorization")
    if key is None and "x-api-key" in request.headers:
        key = f"Bearer {request.headers['x-api-key']}"
    if key is None and "api_key" in request.query_params:
        key = f"Bearer {request.query_params['api_key']}"
    return {"authorization": key} if key is not None else {}


def get_router(request: Request) -> PDRouter:
    return request.app.state.router


RouterDep = Annotated[PDRouter, Depends(get_router)]
# to_all: the routes that reach the decode instances before the prefill ones
_DECODE_FIRST = ("/pause", "/pause_generation", "/is_paused", "/update_weights_from_disk",
                 "/sleep", "/release_memory_occupation")
routes = APIRouter()


# The bodies are parsed with the server's own models: a request the server refuses is
# refused here with the same 400, before it costs a prefill.
@routes.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request, router: RouterDep):
    body.check_disaggregated()
    return await router.forward("/v1/completions", body.stream, request)


@routes.post("/generate")
async def generate(body: GenerateRequest, request: Request, router: RouterDep):
    try:
        body.completion_request().check_disaggregated()
    except APIError as exc:
        raise in_sglang_terms(exc) from None
    return await router.forward("/generate", body.stream, request)


@routes.post("/encode")
async def encode(body: EncodeRequest, request: Request, router: RouterDep):
    return await router.to_prefill("/encode", request)


@routes.get("/get_model_info")
async def get_model_info(request: Request, router: RouterDep):
    return await router.relay("/get_model_info", request)


@routes.get("/get_server_info")
async def get_server_info(request: Request, router: RouterDep):
    return await router.relay("/get_server_info", request)


@routes.post("/abort_request")
async def abort_request(body: AbortRequest, request: Request, router: RouterDep):
    return await router.to_all("/abort_request", request)  # wherever the request runs


async def to_every_instance(request: Request, router: RouterDep):
    """Pausing and sleeping (tidal/server/pausing.py), weight updates (weight_updates.py)."""
    return await router.to_all(request.url.path, request)


for _path in ("/pause", "/resume", "/pause_generation", "/continue_generation", "/sleep",
              "/wake_up", "/update_weights_from_disk", "/release_memory_occupation",
              "/resume_memory_occupation", "/is_paused", "/is_sleeping", "/get_weight_version"):
    routes.add_api_route(_path, to_every_instance,
                         methods=["GET" if _path.startswith(("/is_", "/get_")) else "POST"])


@routes.post("/v1/chat/completions")
async def chat(body: ChatRequest, request: Request, router: RouterDep):
    body.check_disaggregated()
    return await router.forward("/v1/chat/completions", body.stream, request)


@routes.post("/v1/messages")
async def messages(body: MessagesRequest, request: Request, router: RouterDep):
    return await router.forward("/v1/messages", body.stream, request)


@routes.post("/v1/messages/count_tokens")
async def count_tokens(body: MessagesRequest, request: Request, router: RouterDep):
    return await router.relay("/v1/messages/count_tokens", request)


@routes.post("/v1/responses")
async def responses(body: ResponsesRequest, request: Request, router: RouterDep):
    """A continuation goes to the decode instance that stored its predecessor."""
    holder = None
    if body.previous_response_id is not None:
        holder = await router.holder(body.previous_response_id, request)
        if holder is None:
            raise not_stored(body.previous_response_id, "previous_response_id")
    return await router.forward("/v1/responses", body.stream, request, holder)


@routes.get("/v1/responses/{response_id}")
@routes.delete("/v1/responses/{response_id}")
async def stored_response(response_id: str, request: Request, router: RouterDep):
    holder = await router.holder(response_id, request)
    if holder is None:
        raise not_stored(response_id)
    return await router.relay(f"/v1/responses/{quote(response_id, safe='')}", request, holder)


@routes.post("/v1/responses/{response_id}/cancel")
async def cancel_response(response_id: str, request: Request, router: RouterDep):
    holder = await router.holder(response_id, request)
    if holder is None:
        raise not_stored(response_id)
    return await router.relay(f"/v1/responses/{quote(response_id, safe='')}/cancel", request,
                              holder)


@routes.post("/v1/embeddings")
async def embeddings(body: EmbeddingRequest, request: Request, router: RouterDep):
    return await router.to_prefill("/v1/embeddings", request)


@routes.post("/v1/score")
@routes.post("/score", include_in_schema=False)
async def score(body: ScoreRequest, request: Request, router: RouterDep):
    return await router.to_prefill("/v1/score", request)


@routes.post("/v1/rerank")
@routes.post("/rerank", include_in_schema=False)
@routes.post("/v2/rerank", include_in_schema=False)
async def rerank(body: RerankRequest, request: Request, router: RouterDep):
    return await router.to_prefill("/v1/rerank", request)


@routes.post("/reset_prefix_cache")
@routes.post("/flush_cache", include_in_schema=False)
async def reset_prefix_cache(request: Request, router: RouterDep):
    return await router.to_all("/reset_prefix_cache", request)


@routes.post("/classify")
@routes.post("/v1/classify", include_in_schema=False)
async def classify(body: ClassifyRequest, request: Request, router: RouterDep):
    return await router.to_prefill("/classify", request)


@routes.api_route("/v1/files{rest:path}", methods=["GET", "POST", "DELETE"],
                  include_in_schema=False)
@routes.api_route("/v1/batches{rest:path}", methods=["GET", "POST"], include_in_schema=False)
async def batch_api(rest: str):
    """A batch's lines would need the router's own runner and store: not here."""
    raise APIError("the P/D router does not serve the Batch API (/v1/files, /v1/batches): "
                   "run batches on a `tidal serve` without --role, or offline with "
                   "`tidal run-batch`", 404, code="unsupported_endpoint")


@routes.get("/v1/models")
async def models(request: Request, router: RouterDep):
    return await router.relay("/v1/models", request)


@routes.get("/v1/models/{model:path}")
async def model(model: str, request: Request, router: RouterDep):
    return await router.relay(f"/v1/models/{quote(model, safe='')}", request)


@routes.post("/tokenize")
async def tokenize(body: TokenizeRequest, request: Request, router: RouterDep):
    return await router.relay("/tokenize", request)


@routes.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request, router: RouterDep):
    return await router.relay("/detokenize", request)


@routes.get("/health")
async def health(router: RouterDep):
    return await router.health()


@routes.get("/dashboard", response_class=HTMLResponse)
async def dashboard():
    return HTMLResponse(page_html(title="tidal router: prefill and decode instances"))


routes.add_api_route("/favicon.ico", favicon, include_in_schema=False)


@routes.get("/dashboard/stream")
async def dashboard_stream(request: Request, router: RouterDep):
    return StreamingResponse(router.dashboard_events(_auth_header(request)),
                             media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})


def build_router_app(router: PDRouter, http: HttpConfig | None = None,
                     on_shutdown=None) -> FastAPI:
    """The router's app; `on_shutdown` runs after it stops (`--pd` stops its instances).
    With an API key it checks keys itself, so a refusal comes in the server's order; bodies
    and headers over the limits are refused as the server refuses them."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await router.wait_ready()
        log.info("router ready: prefill %s, decode %s", [i.url for i in router.prefill],
                 [i.url for i in router.decode])
        watch = asyncio.create_task(router.watch_health())
        yield
        watch.cancel()
        await router.http.aclose()
        if on_shutdown is not None:
            on_shutdown()

    app = FastAPI(title="tidal router", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.router = router
    http = http or HttpConfig()
    install_error_handlers(app, http)
    install_docs(app)
    app.include_router(routes)
    install_schema(app, None, bool(http.key))
    return app
