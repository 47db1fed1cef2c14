"""The FastAPI app in front of the engine-core process: health, version, metrics and models
here; the generation routes (completions, chat, embeddings, tokenize) in
`generation_routes.py`, the Responses API in `responses/`, LoRA adapters in
`lora_routes.py`, the Batch API in `batches/`, SGLang's native API in `sglang/`, pausing
and sleep in `pausing.py`, weight updates in `weight_updates.py`, the live dashboard in
`dashboard.py`, SageMaker's /invocations in `sagemaker.py`, vLLM's and SGLang's load reports
in `load.py`. Every route works through the one `Frontend` (`frontend.py`); the server's
options are in `config.py`."""

from __future__ import annotations

import asyncio
import time
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Literal

from fastapi import APIRouter, FastAPI, Request
from pydantic import Field
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from tidal import __version__
from tidal.runtime.client import CoreClient
from tidal.server.config import ServerConfig
from tidal.server.anthropic.routes import routes as anthropic_routes
from tidal.server.batches.routes import routes as batch_routes
from tidal.server.batches.runner import BatchRunner
from tidal.server.dashboard import routes as dashboard_routes
from tidal.server.errors import authorized, install_docs, install_error_handlers
from tidal.server.frontend import Frontend, FrontendDep, unavailable
from tidal.server.generation_routes import routes as generation_routes
from tidal.server.load import install_load, routes as load_routes
from tidal.server.lora_routes import routes as lora_routes
from tidal.server.openai.protocol import APIError, StrictModel
from tidal.server.openapi import install_schema
from tidal.server.pausing import routes as pausing_routes
from tidal.server.sagemaker import routes as sagemaker_routes
from tidal.server.weight_updates import routes as weight_routes
from tidal.server.responses.routes import routes as responses_routes
from tidal.server.score_routes import routes as score_routes
from tidal.server.sglang.routes import routes as sglang_routes

routes = APIRouter()


@routes.get("/health")
@routes.api_route("/ping", methods=["GET", "POST"], include_in_schema=False)  # SageMaker's
async def health(f: FrontendDep, request: Request):
    """Whether the server serves, and how its cores fare; their process ids only to a
    caller with the API key where there is one (an open endpoint tells no internals)."""
    client = f.client
    restarts = {"core_restarts": sum(s.restarts for s in client.watch.cores),
                "restarting": client.watch.restarting}
    if client.num_cores > 1:
        restarts["cores"] = [s.status() for s in client.watch.cores]
    if not client.alive:  # the error body, and how the cores fare
        exc = unavailable(client.unavailable())
        retry = {"Retry-After": str(exc.retry_after)} if exc.retry_after is not None else None
        return JSONResponse({**exc.body(), **restarts}, exc.status, headers=retry)
    body = {"status": "ok", "engine_core_pid": client.pid, "role": client.config.scheduler.role,
            "paused": client.paused, "sleeping": "sleep" in client.holds, **restarts}
    if client.ready.kv_address:  # P/D: where the router points the other side
        body["kv_address"] = client.ready.kv_address
    if client.num_cores > 1:  # data parallel: serving on while any core lives
        body.update(engine_core_pids=client.pids,
                    dead_cores={str(i): why for i, why in client.dead_cores.items()})
    key = f.config.key
    if key and not authorized(request, f"Bearer {key}".encode()):
        body.pop("engine_core_pid")
        body.pop("engine_core_pids", None)
    return body


@routes.get("/version")
async def version():
    return {"version": __version__}


@routes.get("/metrics", response_class=Response)
async def prometheus(f: FrontendDep):
    """Prometheus' text format."""
    return Response(generate_latest(f.metrics.registry), media_type=CONTENT_TYPE_LATEST)


@routes.post("/reset_prefix_cache")
@routes.post("/flush_cache", include_in_schema=False)
async def reset_prefix_cache(f: FrontendDep):
    """vLLM's (SGLang's /flush_cache): every core forgets its cached prefixes, so a prompt
    seen before is computed anew (a cold measurement; the KV tiers below keep theirs)."""
    f.client.reset_prefix_cache()
    return Response(status_code=200)


class ProfileRequest(StrictModel):
    """SGLang's /start_profile body (vLLM's takes none): `num_steps` ends the trace after
    that many steps; the traces go to --profiler-dir, the only `output_dir` taken."""

    output_dir: str | None = None
    num_steps: int | None = Field(None, ge=1)
    activities: list[Literal["CPU", "GPU"]] | None = None  # CPU, and CUDA on a GPU


def _profiler_dir(f: Frontend) -> str:
    """Where the cores' traces go; a 400 where profiling is off."""
    folder = f.client.config.model.profiler_dir
    if folder is None:
        raise APIError("profiling is off: start the server with --profiler-dir DIR")
    return folder


@routes.post("/start_profile")
async def start_profile(f: FrontendDep, body: ProfileRequest | None = None):
    """vLLM's and SGLang's: every engine core records a torch.profiler trace of its work
    until /stop_profile (or `num_steps` steps), written to --profiler-dir."""
    folder = _profiler_dir(f)
    body = body or ProfileRequest()
    if body.output_dir is not None and Path(body.output_dir).resolve() != Path(folder).resolve():
        raise APIError(f"traces go to --profiler-dir ({folder}) only", param="output_dir")
    f.client.profile(body.num_steps or 0)
    return Response(status_code=200)


@routes.post("/stop_profile")
async def stop_profile(f: FrontendDep):
    """vLLM's and SGLang's: end the traces and write them (a file per core in
    --profiler-dir, named in the cores' log)."""
    _profiler_dir(f)
    f.client.profile(None)
    return Response(status_code=200)


@routes.get("/v1/models")
async def models(f: FrontendDep):
    """The served model, then its LoRA adapters (each with the model as `parent`)."""
    return {"object": "list", "data": _model_cards(f)}


@routes.get("/v1/models/{model:path}")
async def model(model: str, f: FrontendDep):
    """OpenAI's retrieve: the served model or an adapter, or a 404 naming any other."""
    cards = {card["id"]: card for card in _model_cards(f)}
    if model not in cards:
        raise APIError(f"the model {model!r} does not exist; this server serves "
                       f"{', '.join(map(repr, cards))}", 404, param="model",
                       code="model_not_found")
    return cards[model]


def _model_cards(f: Frontend) -> list[dict]:
    created, length = int(time.time()), f.client.ready.max_model_len
    return [{"id": name, "object": "model", "created": created, "owned_by": "tidal",
             "root": str(f.client.folder), "parent": None, "max_model_len": length}
            for name in f.config.served_model_name] + f.adapters.cards(created, length)


@asynccontextmanager
async def _lifespan(app: FastAPI):
    frontend: Frontend = app.state.frontend
    await frontend.client.start()
    batches = frontend.batches and asyncio.create_task(frontend.batches.run())
    yield
    if batches:  # its lines in flight are aborted; a restart answers them
        batches.cancel()
        await asyncio.gather(batches, return_exceptions=True)
    await frontend.client.shutdown(frontend.config.drain_timeout)
    if frontend.tracing is not None:  # the spans not yet exported
        frontend.tracing.shutdown()


def build_app(client: CoreClient, config: ServerConfig, batches: bool = True) -> FastAPI:
    """The server's app over `client`'s engine cores (started and stopped with the app);
    with `batches`, the Batch API's files and batches, worked through while it runs."""
    docs = not config.disable_fastapi_docs
    app = FastAPI(title="tidal", version=__version__, lifespan=_lifespan, docs_url=None,
                  redoc_url=None, openapi_url="/openapi.json" if docs else None)
    frontend = app.state.frontend = Frontend(client, config)
    if batches:
        frontend.batches = BatchRunner(frontend, app, config.batch_store_path(),
                                       config.batch_concurrency, config.batch_file_days)
    install_load(app)  # inside the checks below: a refused request never counts
    install_error_handlers(app, config, {"/v1/files": config.max_file_bytes})
    for middleware in config.middleware_objects():  # outermost: they see every request
        if isinstance(middleware, type):
            app.add_middleware(middleware)
        else:
            app.middleware("http")(middleware)
    if docs:
        install_docs(app)
    app.include_router(routes)
    app.include_router(generation_routes)
    app.include_router(responses_routes)
    app.include_router(anthropic_routes)
    app.include_router(score_routes)
    app.include_router(sagemaker_routes)
    app.include_router(sglang_routes)
    app.include_router(pausing_routes)
    app.include_router(weight_routes)
    app.include_router(batch_routes)
    app.include_router(lora_routes)
    app.include_router(dashboard_routes)
    app.include_router(load_routes)
    lora = client.config.lora  # the names `model` takes (any, where adapters come and go)
    names = (None if lora.enable_lora and config.enable_lora_runtime_updates
             else [*config.served_model_name, *lora.modules])
    if docs:
        install_schema(app, names, bool(config.key))
    return app
