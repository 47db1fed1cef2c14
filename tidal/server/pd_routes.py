"""`tidal router`'s routes and app over a `PDRouter` (pd_router.py): each generation route
parses its body with the server's own models (a request the server refuses is refused here
with the same 400, before it costs a prefill) and forwards it through a decode instance;
the routes that end at a prompt go to a prefill instance; control routes (pausing, sleep,
weight updates, prefix-cache resets, aborts) go to every instance. SageMaker's
/invocations goes where its body's endpoint goes."""

from __future__ import annotations

import asyncio
import logging
from contextlib import asynccontextmanager
from typing import Annotated
from urllib.parse import quote

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import HTMLResponse, Response, StreamingResponse

from tidal.server.config import HttpConfig
from tidal.server.dashboard import favicon, page_html
from tidal.server.errors import install_docs, install_error_handlers
from tidal.server.load import install_load, load
from tidal.server.openapi import install_schema
from tidal.server.openai.chat import ChatRequest, TokenizeRequest
from tidal.server.anthropic.request import MessagesRequest
from tidal.server.openai.embeddings import EmbeddingRequest
from tidal.server.openai.protocol import APIError, CompletionRequest, DetokenizeRequest
from tidal.server.pd_router import PDRouter, auth_header
from tidal.server.responses.request import ResponsesRequest
from tidal.server.responses.routes import not_stored
from tidal.server.sagemaker import SCHEMA, read_invocation
from tidal.server.scoring import ClassifyRequest, RerankRequest, ScoreRequest
from tidal.server.sglang.request import (AbortRequest, EncodeRequest, GenerateRequest,
                                         in_sglang_terms)

log = logging.getLogger("tidal.router")


def get_router(request: Request) -> PDRouter:
    return request.app.state.router


RouterDep = Annotated[PDRouter, Depends(get_router)]
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
    """Pausing and sleeping (tidal/server/pausing.py), weight updates (weight_updates.py),
    profiling (api.py)."""
    return await router.to_all(request.url.path, request)


for _path in ("/pause", "/resume", "/pause_generation", "/continue_generation", "/sleep",
              "/wake_up", "/update_weights_from_disk", "/release_memory_occupation",
              "/resume_memory_occupation", "/start_profile", "/stop_profile", "/is_paused",
              "/is_sleeping", "/get_weight_version"):
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


@routes.get("/health_generate")
async def health_generate(request: Request, router: RouterDep):
    """SGLang's: 200 once a one-token generation went through a prefill and a decode
    instance (or the decode one is paused or asleep), else 503; open, as /health is."""
    http = request.app.state.http
    await router.probe(http.key, http.health_generate_timeout)
    return Response(status_code=200)


@routes.get("/health")
@routes.api_route("/ping", methods=["GET", "POST"], include_in_schema=False)  # SageMaker's
async def health(router: RouterDep):
    return await router.health()


@routes.post("/invocations", **SCHEMA)
async def invocations(request: Request, router: RouterDep):
    """SageMaker's: relayed as its body's endpoint is (sagemaker.py)."""
    kind, body = await read_invocation(request)
    return await _ENDPOINTS[kind.path](body, request, router)


@routes.get("/dashboard", response_class=HTMLResponse)
async def dashboard():
    return HTMLResponse(page_html(title="tidal router: prefill and decode instances"))


routes.add_api_route("/favicon.ico", favicon, include_in_schema=False)


@routes.get("/dashboard/stream")
async def dashboard_stream(request: Request, router: RouterDep):
    return StreamingResponse(router.dashboard_events(auth_header(request)),
                             media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})


_ENDPOINTS = {"/v1/chat/completions": chat, "/v1/completions": completions,
              "/v1/embeddings": embeddings, "/classify": classify, "/v1/score": score,
              "/v1/rerank": rerank}


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
    http = app.state.http = http or HttpConfig()
    install_load(app)  # vLLM's /load: the requests the router is answering
    install_error_handlers(app, http)
    install_docs(app)
    app.include_router(routes)
    app.add_api_route("/load", load, methods=["GET"])
    install_schema(app, None, bool(http.key))
    return app
