"""The FastAPI app: OpenAI-compatible completions and chat completions (streamed over SSE or
not), models, health, version and metrics, in front of the engine-core process."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from tidal import __version__
from tidal.engine.outputs import StepUpdate
from tidal.server.client import CoreClient, EngineDeadError, Failure
from tidal.server.metrics import ServerMetrics
from tidal.server.protocol import APIError, ChatRequest, CompletionRequest


@dataclass
class ServerConfig:
    """What the HTTP layer enforces in front of the engine."""

    model_name: str = "smollm2-135m"
    api_key: str | None = None
    max_pending: int = 512  # outstanding requests before new ones get 429
    max_n: int = 16
    drain_timeout: float = 30.0


@dataclass
class _Choice:
    text: str = ""
    tokens: list[int] = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    finish_reason: str | None = None
    message: str | None = None


def build_app(client: CoreClient, config: ServerConfig) -> FastAPI:
    metrics = ServerMetrics(client)
    tokenizer = client.tokenizer

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await client.start()
        yield
        await client.shutdown(config.drain_timeout)

    app = FastAPI(title="tidal", version=__version__, lifespan=lifespan)

    # ------------------------------------------------------------------ errors and auth
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError):
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError):
        errors = exc.errors()
        first = errors[0] if errors else {}
        where = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        return JSONResponse(APIError(f"{where or 'body'}: {first.get('msg', 'invalid')}",
                                     param=where).body(), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException):
        return JSONResponse(APIError(str(exc.detail), exc.status_code).body(),
                            status_code=exc.status_code)

    @app.middleware("http")
    async def _auth(request: Request, call_next):
        if config.api_key and request.url.path.startswith("/v1"):
            if request.headers.get("authorization") != f"Bearer {config.api_key}":
                err = APIError("invalid or missing API key", 401, "authentication_error")
                return JSONResponse(err.body(), status_code=401)
        return await call_next(request)

    # ------------------------------------------------------------------ small endpoints
    @app.get("/health")
    async def health():
        if not client.alive:
            return JSONResponse(APIError(client.dead or "engine core not running", 503,
                                         "service_unavailable").body(), status_code=503)
        body = {"status": "ok", "engine_core_pid": client.pid,
                "role": client.config.scheduler.role}
        if client.ready.kv_address:  # P/D: where the router points the other side
            body["kv_address"] = client.ready.kv_address
        if client.num_cores > 1:  # data parallel: serving on while any core lives
            body.update(engine_core_pids=client.pids,
                        dead_cores={str(i): why for i, why in client.dead_cores.items()})
        return body

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.get("/metrics")
    async def prometheus():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{
            "id": config.model_name, "object": "model", "created": int(time.time()),
            "owned_by": "tidal", "max_model_len": client.ready.max_model_len}]}

    # ------------------------------------------------------------------ generation
    def check_model(name: str | None) -> None:
        if name is not None and name != config.model_name:
            raise APIError(f"the model {name!r} does not exist; this server serves "
                           f"{config.model_name!r}", param="model")

    async def submit(prompts: list[list[int]], body, max_tokens, logprobs,
                     default_max) -> tuple[list[str], asyncio.Queue, int]:
        if not client.alive:
            raise APIError(client.dead or "engine core not running", 503, "service_unavailable")
        if client.num_outstanding + len(prompts) > config.max_pending:
            raise APIError("too many requests in flight; retry later", 429, "rate_limit_error")
        params = []
        for ids in prompts:
            if not ids:
                raise APIError("the prompt is empty", param="prompt")
            if any(not 0 <= t < client.ready.vocab_size for t in ids):
                raise APIError("prompt token ids out of the vocabulary", param="prompt")
            params.append(body.sampling_params(max_tokens, logprobs, config.max_n, len(ids),
                                               client.ready.max_model_len, default_max))
        prefill = (body.kv_transfer_params or {}).get("prefill_address")
        if prefill is not None and params[0].n > 1:
            raise APIError("n > 1 is not supported with prefill/decode disaggregation",
                           param="n")
        queue: asyncio.Queue = asyncio.Queue()
        base = uuid.uuid4().hex[:16]
        rids = [f"{base}-{i}" for i in range(len(prompts))]
        try:
            for rid, ids, p in zip(rids, prompts, params):
                await client.add(rid, ids, p, queue, prefill)
        except EngineDeadError as exc:
            raise APIError(str(exc), 503, "service_unavailable") from exc
        return rids, queue, params[0].n

    async def updates(rids: list[str], queue: asyncio.Queue, n: int):
        """(choice index, update) until every choice finished; aborts on early exit."""
        index_of = {rid: i for i, rid in enumerate(rids)}
        left = len(rids) * n
        t0 = time.perf_counter()
        first, last = None, {}
        try:
            while left:
                item = await queue.get()
                if isinstance(item, Failure):
                    raise APIError(item.message, 503 if item.dead else 400,
                                   "service_unavailable" if item.dead else "invalid_request_error")
                u: StepUpdate = item
                now = time.perf_counter()
                if u.new_token_ids:
                    if first is None:
                        first = now
                        metrics.ttft.observe(now - t0)
                    elif u.request_id in last:
                        metrics.itl.observe(now - last[u.request_id])
                    last[u.request_id] = now
                if u.finished:
                    left -= 1
                    metrics.finished.labels(u.finish_reason or "unknown").inc()
                yield index_of[u.root_id] * n + u.index, u
            metrics.e2e.observe(time.perf_counter() - t0)
        finally:
            for rid in rids:
                if left:
                    await client.abort(rid)  # client gone or an error: free the blocks now
                else:
                    client.release(rid)

    def usage(prompts, choices) -> dict:
        p = sum(len(ids) for ids in prompts)  # once per prompt, whatever n is
        c = sum(len(ch.tokens) for ch in choices)
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}

    def token_text(t: int) -> str:
        return tokenizer.decode([t], skip_special_tokens=False)

    def chat_logprobs(entries) -> dict:
        return {"content": [{
            "token": token_text(t), "logprob": lp, "bytes": list(token_text(t).encode()),
            "top_logprobs": [{"token": token_text(a), "logprob": alp,
                              "bytes": list(token_text(a).encode())} for a, alp in alts]}
            for t, (lp, alts) in entries]}

    def completion_logprobs(entries, offset: int) -> dict:
        tokens, lps, tops, offsets = [], [], [], []
        for t, (lp, alts) in entries:
            text = token_text(t)
            tokens.append(text)
            lps.append(lp)
            tops.append({token_text(a): alp for a, alp in alts})
            offsets.append(offset)
            offset += len(text)
        return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops,
                "text_offset": offsets}

    def sse(obj) -> str:
        return f"data: {json.dumps(obj)}\n\n"

    async def run(kind: str, body, prompts: list[list[int]], max_tokens, logprobs,
                  default_max):
        rids, queue, n = await submit(prompts, body, max_tokens, logprobs, default_max)
        choices = [_Choice() for _ in range(len(prompts) * n)]
        rid, created = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{rids[0]}", int(time.time())
        obj = "chat.completion" if kind == "chat" else "text_completion"
        stream = updates(rids, queue, n)

        def logprob_entries(u: StepUpdate):
            return list(zip(u.new_token_ids, u.logprobs or []))

        if not body.stream:
            async for i, u in stream:
                ch = choices[i]
                ch.text += u.new_text
                ch.tokens.extend(u.new_token_ids)
                ch.logprobs.extend(logprob_entries(u))
                if u.finished:
                    ch.finish_reason, ch.message = u.finish_reason, u.finish_message
            for ch in choices:
                if ch.finish_reason == "error":
                    raise APIError(ch.message or "generation failed", 500, "internal_error")
            out = []
            for i, ch in enumerate(choices):
                lp = None
                if logprobs is not None:
                    lp = (chat_logprobs(ch.logprobs) if kind == "chat"
                          else completion_logprobs(ch.logprobs, 0))
                entry = {"index": i, "logprobs": lp, "finish_reason": ch.finish_reason}
                if kind == "chat":
                    entry["message"] = {"role": "assistant", "content": ch.text}
                else:
                    entry["text"] = ch.text
                out.append(entry)
            return {"id": rid, "object": obj, "created": created, "model": config.model_name,
                    "choices": out, "usage": usage(prompts, choices)}

        chunk_obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
        include_usage = bool(body.stream_options and body.stream_options.include_usage)

        async def events():
            def chunk(choices_part, **extra):
                return sse({"id": rid, "object": chunk_obj, "created": created,
                            "model": config.model_name, "choices": choices_part, **extra})
            try:
                if kind == "chat":
                    yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""},
                                  "logprobs": None, "finish_reason": None}
                                 for i in range(len(choices))])
                async for i, u in stream:
                    ch = choices[i]
                    entries = logprob_entries(u)
                    lp = None
                    if logprobs is not None:
                        lp = (chat_logprobs(entries) if kind == "chat"
                              else completion_logprobs(entries, len(ch.text)))
                    ch.text += u.new_text
                    ch.tokens.extend(u.new_token_ids)
                    if u.finish_reason == "error":
                        yield sse(APIError(u.finish_message or "generation failed", 500,
                                           "internal_error").body())
                        continue
                    if not (u.new_text or u.finished or lp):
                        continue
                    part = {"index": i, "logprobs": lp,
                            "finish_reason": u.finish_reason if u.finished else None}
                    if kind == "chat":
                        part["delta"] = {"content": u.new_text} if u.new_text else {}
                    else:
                        part["text"] = u.new_text
                    yield chunk([part], **({"usage": None} if include_usage else {}))
                if include_usage:
                    yield chunk([], usage=usage(prompts, choices))
            except APIError as exc:
                yield sse(exc.body())
            finally:
                await stream.aclose()  # a closed connection lands here: abort at once
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest):
        check_model(body.model)
        if body.echo:
            raise APIError("echo is not supported", param="echo")
        p = body.prompt
        if isinstance(p, str):
            prompts = [tokenizer.encode(p)] if p else [[]]
        elif p and all(isinstance(x, str) for x in p):
            prompts = [tokenizer.encode(x) for x in p]
        elif p and all(isinstance(x, int) for x in p):
            prompts = [list(p)]
        elif p and all(isinstance(x, list) for x in p):
            prompts = [list(x) for x in p]
        else:
            raise APIError("the prompt is empty", param="prompt")
        return await run("completion", body, prompts, body.max_tokens, body.logprobs, 16)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest):
        check_model(body.model)
        if not body.messages:
            raise APIError("messages must not be empty", param="messages")
        messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()}
                    for m in body.messages]
        if all(not m["content"] for m in messages):
            raise APIError("the messages hold no text", param="messages")
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        ids = tokenizer.encode(text, add_special_tokens=False)
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        if body.top_logprobs and not body.logprobs:
            raise APIError("top_logprobs needs logprobs=true", param="top_logprobs")
        max_tokens = (body.max_completion_tokens if body.max_completion_tokens is not None
                      else body.max_tokens)
        return await run("chat", body, [ids], max_tokens, logprobs, None)

    return app
