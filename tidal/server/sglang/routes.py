"""SGLang's native API beside OpenAI's, for clients written against an SGLang server:
`POST /generate` (prompts as text or token ids, `sampling_params`, answered in SGLang's
shape: `request.py`, `output.py`), `POST /encode` (embeddings), `GET /get_model_info`,
`GET /get_server_info`, `GET /health_generate` (healthy when the engine makes a token),
`POST /abort_request` (ends requests early, answered with what they have) and
`POST /pause_generation` / `POST /continue_generation` and `/release_memory_occupation` /
`/resume_memory_occupation` (`pausing.py`);
`POST /update_weights_from_disk` is in `weight_updates.py`.
/flush_cache, /tokenize, /detokenize, /v1/rerank and /classify are the server's own
routes."""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import asdict

from fastapi import APIRouter, Request
from fastapi.responses import Response

from tidal import __version__
from tidal.core import SamplingParams
from tidal.runtime.client import EngineDeadError, Failure
from tidal.server.frontend import Frontend, FrontendDep, unavailable
from tidal.server.openai.protocol import APIError
from tidal.server.sglang.output import GenerateBody
from tidal.server.pausing import pause, sleep, wake
from tidal.server.sglang.request import (SAMPLING, AbortRequest, EncodeRequest,
                                         GenerateRequest, MemoryTags, PauseGeneration,
                                         in_sglang_terms, prompt_error)

routes = APIRouter()
_SGLANG_NAMES = {field: name for name, field in SAMPLING.items()}  # tidal's -> SGLang's


@routes.post("/generate")
async def generate(body: GenerateRequest, f: FrontendDep, request: Request):
    """SGLang's: completions of each prompt, as `text`, `output_ids` and `meta_info`."""
    f.check_model(body.adapter())
    f.check_task("generate")
    completion = body.completion_request()
    prompts = await asyncio.to_thread(completion.prompt_ids, f.tokenizer)  # as completions
    try:
        return await f.generate(
            GenerateBody, completion, prompts, request, prompt_only=completion.prompt_only,
            rids=body.rids(), batch=body.is_batch(), top=body.top_logprobs_num,
            start=body.logprob_start_len if body.return_logprob and
            body.logprob_start_len >= 0 else None,
            text_in_logprobs=body.return_text_in_logprobs)
    except APIError as exc:
        raise in_sglang_terms(exc) from None


@routes.post("/abort_request")
async def abort_request(body: AbortRequest, f: FrontendDep):
    """SGLang's: end the request `rid` names (or every one, `abort_all`) now; each answers
    what it generated so far with finish_reason {"type": "abort"} ("abort" in OpenAI's
    bodies), and its blocks are freed. A name nothing in flight has is no error (the
    request may have just finished): 200 either way, as SGLang answers."""
    if not body.abort_all and not body.rid:
        raise APIError("name the request to abort (rid) or set abort_all", param="rid")
    message = body.abort_message or "aborted by /abort_request"
    await f.in_flight.stop(None if body.abort_all else body.rid, message)
    return Response(status_code=200)


@routes.post("/pause_generation")
async def pause_generation(f: FrontendDep, body: PauseGeneration | None = None):
    """SGLang's: hold new requests until /continue_generation; those in flight are
    aborted (`mode` abort, answered with what they have) or held in place (`in_place`)."""
    await pause(f, "keep" if body is not None and body.mode == "in_place" else "abort",
                clear_cache=False)
    return {"message": "Generation paused successfully.", "status": "ok"}


@routes.post("/continue_generation")
async def continue_generation(f: FrontendDep):
    """SGLang's: generate again; held requests go on in the order they came."""
    f.client.resume()
    return {"message": "Generation continued successfully.", "status": "ok"}


@routes.post("/release_memory_occupation")
async def release_memory_occupation(f: FrontendDep, body: MemoryTags | None = None):
    """SGLang's: once the requests in flight finished, stop the engine cores, their weights
    and KV cache freed (every part, whatever `tags` names), until
    /resume_memory_occupation; new requests wait."""
    await sleep(f, "wait")
    return Response(status_code=200)


@routes.post("/resume_memory_occupation")
async def resume_memory_occupation(f: FrontendDep, body: MemoryTags | None = None):
    """SGLang's: start the engine cores again (every part at once)."""
    await wake(f)
    return Response(status_code=200)


@routes.post("/encode")
async def encode(body: EncodeRequest, f: FrontendDep, request: Request):
    """SGLang's: each prompt's embedding, as `embedding` and `meta_info`."""
    f.check_model(body.adapter())
    f.check_task("embed")
    embedding = body.embedding_request()
    try:
        embedding.check_dimensions(f.client.ready.embedding_size, f.client.ready.matryoshka)
        prompts = await asyncio.to_thread(embedding.prompt_ids, f.tokenizer)  # as embeddings
        return await f.embed(embedding, prompts, request)
    except APIError as exc:
        raise prompt_error(exc, body) from None


@routes.get("/get_model_info")
async def get_model_info(f: FrontendDep):
    """SGLang's: the model's path, whether it generates, its recommended sampling."""
    path = f.client.config.model.model
    preferred = {_SGLANG_NAMES.get(k, k): v for k, v in f.sampling_defaults.items()}
    return {"model_path": path, "tokenizer_path": path,
            "is_generation": f.config.task in ("auto", "generate"),
            "preferred_sampling_params": preferred or None,
            "weight_version": f.client.weight_version,
            "has_image_understanding": False, "has_audio_understanding": False}


@routes.get("/get_server_info")
async def get_server_info(f: FrontendDep):
    """SGLang's: the settings the server runs with (SGLang's names for those clients read,
    then tidal's whole configuration; never the API key) and its KV pool's size."""
    engine, ready = f.client.config, f.client.ready
    server = {k: v for k, v in asdict(f.config).items() if not k.startswith("api_key")}
    return {"version": __version__, "model_path": engine.model.model,
            "served_model_name": f.config.model_name,
            "context_length": ready.max_model_len, "page_size": ready.block_size,
            "max_total_num_tokens": ready.num_blocks * ready.block_size,
            "max_running_requests": engine.scheduler.max_num_seqs,
            "chunked_prefill_size": engine.scheduler.chunked_prefill_size,
            "tp_size": engine.parallel.tensor_parallel_size,
            "dp_size": engine.parallel.data_parallel_size,
            "engine": asdict(engine), "server": server}


@routes.get("/health_generate")
async def health_generate(f: FrontendDep):
    """SGLang's: 200 once the engine made one token for a one-token prompt (callers at
    the same time share one probe), or when other requests got tokens while it waited;
    else 503; 200 while paused or asleep. Open like /health: a probe adds one sequence, whatever the
    callers. A P/D instance cannot generate alone: a 400 says so."""
    if f.client.holds:  # paused or asleep: idle on purpose; a probe would wait for the end
        return Response(status_code=200)
    role = f.client.config.scheduler.role
    if role != "mixed":
        raise APIError(f"this is a {role} instance: its requests need the other side (through "
                       f"`tidal router`); /health says whether it serves")
    probe = f.health_probe
    if probe is None or probe.done():
        probe = f.health_probe = asyncio.ensure_future(_probe(f))
    failure = await asyncio.shield(probe)
    if failure is not None:
        raise APIError(f"the engine made no token: {failure}", 503, "service_unavailable")
    return Response(status_code=200)


async def _probe(f: Frontend) -> str | None:
    """None when a one-token generation finishes (or another request's tokens came within
    the timeout), else why not."""
    client, timeout = f.client, f.config.health_generate_timeout
    rid, start = f"health-{uuid.uuid4().hex[:12]}", time.monotonic()
    queue: asyncio.Queue = asyncio.Queue()
    try:
        await client.add(rid, [0], SamplingParams(max_tokens=1, temperature=0.0), queue)
    except EngineDeadError as exc:
        return unavailable(exc).message
    finished = False
    try:
        async with asyncio.timeout(timeout):
            while not finished:
                item = await queue.get()
                if isinstance(item, Failure):
                    return item.message
                finished = item.finished
                if finished and item.finish_reason == "error":
                    return item.finish_message or "generation failed"
        return None
    except TimeoutError:
        if client.last_output > start:  # busy, not stuck: others' tokens came meanwhile
            return None
        return f"no token within {timeout:g} s (--health-generate-timeout)"
    finally:
        if finished:
            client.release(rid)
        else:
            await client.abort(rid)
