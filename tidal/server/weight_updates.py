"""New weights without restarting the server, as RL trainers load each new policy:
SGLang's `POST /update_weights_from_disk` (a checkpoint folder or GGUF file of the served
model's architecture) and `GET /get_weight_version`.

New requests wait meanwhile, unsent; those in flight finish first (or, with
`abort_all_requests`, end at once answered with what they have); then the engine cores are
started again on the new weights. Weights that do not load leave the old ones
serving, and the answer says why."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from tidal.model.config import UnsupportedModelError
from tidal.model.registry import resolve_model
from tidal.server.frontend import Frontend, FrontendDep
from tidal.server.openai.protocol import APIError, StrictModel
from tidal.server.pausing import check_drainable, settle

routes = APIRouter()

# what a checkpoint's config.json must share with the served model's: its shape
SHAPE = ("model_type", "architectures", "vocab_size", "hidden_size", "num_hidden_layers",
         "num_attention_heads", "num_key_value_heads", "intermediate_size", "head_dim")


class UpdateWeightsFromDisk(StrictModel):
    """SGLang's UpdateWeightFromDiskReqInput: where the weights are, whether to abort the
    requests in flight rather than let them finish, and the version to report after."""

    model_path: str
    load_format: str | None = None  # "auto" or none: the files say their format
    abort_all_requests: bool = False
    weight_version: str | None = None


def shape(folder: str | Path) -> dict:
    """The fields of a model folder's config.json that fix its architecture's shape."""
    config = json.loads((Path(folder) / "config.json").read_text())
    return {k: config.get(k) for k in SHAPE}


async def update_weights(f: Frontend, body: UpdateWeightsFromDisk) -> None:
    """Serve the weights at `body.model_path`, or raise an APIError saying why not (the old
    weights serving on)."""
    client = f.client
    if body.load_format not in (None, "auto"):
        raise APIError(f"load_format {body.load_format!r} is not supported: the files say "
                       f"their format (safetensors, GGUF)", param="load_format")
    if client.config.parallel.nnodes > 1:
        raise APIError("the weights of an engine core that spans machines (--nnodes) cannot "
                       "be updated in place; restart the servers on them")
    try:
        folder, _ = await asyncio.to_thread(resolve_model, body.model_path)
        new, served = shape(folder), shape(client.folder)
    except (FileNotFoundError, UnsupportedModelError, ValueError) as exc:
        raise APIError(str(exc), param="model_path") from None
    if new != served:
        diff = ", ".join(f"{k} {new[k]!r} (served: {served[k]!r})"
                         for k in SHAPE if new[k] != served[k])
        raise APIError(f"{body.model_path} is not the served model's architecture: {diff}; "
                       f"serve another model with a server of its own", param="model_path")
    async with client.weights_lock:
        if "sleep" in client.holds:
            raise APIError("the engine sleeps: wake it (/wake_up) before updating its weights")
        check_drainable(f, not body.abort_all_requests, "abort_all_requests")
        client.hold("update")
        try:
            await settle(f, body.abort_all_requests, "aborted for a weight update")
            why = await client.swap_weights(str(folder), body.model_path)
        finally:
            client.lift("update")
        if why is not None:
            raise APIError(f"the weights at {body.model_path} did not load: {why}; the old "
                           f"weights serve on", param="model_path")
        client.weight_version = body.weight_version or client.weight_version


@routes.post("/update_weights_from_disk")
async def update_weights_from_disk(body: UpdateWeightsFromDisk, f: FrontendDep):
    """SGLang's: `{"success", "message", "num_paused_requests"}`; a failure is a 400 that
    also carries OpenAI's error body."""
    try:
        await update_weights(f, body)
    except APIError as exc:
        return JSONResponse({**exc.body(), "success": False, "message": exc.message},
                            exc.status)
    return {"success": True, "message": "Succeeded to update model weights.",
            "num_paused_requests": 0}


@routes.get("/get_weight_version")
async def get_weight_version(f: FrontendDep):
    """SGLang's: the version the last weight update named ("default" before any)."""
    return {"weight_version": f.client.weight_version}
