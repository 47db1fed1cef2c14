"""OpenAI's Files and Batches routes: `/v1/files` (upload, list, retrieve, content, delete)
and `/v1/batches` (create, retrieve, list, cancel) over the server's `BatchStore`, made on
first use at --batch-store; the `BatchRunner` works through the batches."""

from __future__ import annotations

import asyncio
import time
from typing import Annotated, Literal

from fastapi import APIRouter, Form, Query, Request, UploadFile
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from tidal.server.batches.lines import URLS
from tidal.server.batches.runner import BatchRunner
from tidal.server.batches.store import LIST_LIMIT
from tidal.server.openai.protocol import APIError

routes = APIRouter()

PURPOSES = ("batch", "user_data", "assistants", "fine-tune", "vision", "evals")
"""What an uploaded file may be for (`batch_output` is the server's own)."""
MAX_LINES = 50_000  # OpenAI's limit on one batch's requests
WINDOWS = {"24h": 24 * 3600}


MIN_EXPIRY, MAX_EXPIRY = 3600, 30 * 24 * 3600  # OpenAI's range for a file's expiry


class ExpiresAfter(BaseModel):
    """When a file expires: `seconds` after it is made (OpenAI's expiration policy)."""

    model_config = ConfigDict(extra="forbid")
    anchor: Literal["created_at"]
    seconds: int = Field(ge=MIN_EXPIRY, le=MAX_EXPIRY)


class BatchCreate(BaseModel):
    """POST /v1/batches."""

    model_config = ConfigDict(extra="forbid")
    input_file_id: str
    endpoint: Literal[URLS]  # type: ignore[valid-type]
    completion_window: Literal["24h"] = "24h"
    metadata: dict[str, str] | None = Field(None, max_length=16)
    output_expires_after: ExpiresAfter | None = None  # unset: the server's batch_file_days


def _runner(request: Request) -> BatchRunner:
    runner = request.app.state.frontend.batches
    if runner is None:
        raise APIError("this server keeps no files or batches (tidal run-batch answers a "
                       "batch file offline)", 404, code="not_found")
    return runner


async def _call(request: Request, method: str, *args):
    """A store method, in a thread: the event loop goes on serving."""
    runner = _runner(request)
    return await asyncio.to_thread(lambda: getattr(runner.store(), method)(*args))


async def _found(request: Request, method: str, key: str, param: str | None = None):
    """The store's `method` for `key` (a file or a batch), or a 404 naming it."""
    found = await _call(request, method, key)
    if found is None:
        kind = "batch" if method == "batch" else "file"
        raise APIError(f"no {kind} with id {key!r}", 404, param=param, code="not_found")
    return found


def _listing(page: list[dict], more: bool) -> dict:
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": more}


@routes.post("/v1/files")
async def upload_file(
        request: Request, file: UploadFile, purpose: Annotated[str, Form()],
        anchor: Annotated[str | None, Form(alias="expires_after[anchor]")] = None,
        seconds: Annotated[int | None, Form(alias="expires_after[seconds]")] = None):
    """Keep an uploaded file (multipart: `file`, `purpose`, and optionally
    `expires_after[anchor]` and `expires_after[seconds]`). A `batch` file expires after the
    server's batch_file_days unless it says otherwise; others are kept until deleted."""
    if purpose not in PURPOSES:
        raise APIError(f"purpose must be one of {', '.join(PURPOSES)}, got {purpose!r}",
                       param="purpose")
    if anchor is not None or seconds is not None:
        try:  # the one statement of the policy's checks, as output_expires_after's
            seconds = ExpiresAfter(anchor=anchor, seconds=seconds).seconds
        except ValidationError as exc:
            first = exc.errors()[0]
            field = first["loc"][0]
            raise APIError(f"expires_after[{field}]: {first['msg']}",
                           param=f"expires_after.{field}") from exc
    else:
        seconds = _runner(request).file_seconds if purpose == "batch" else None
    content = await file.read()
    expires = int(time.time()) + seconds if seconds else None
    return await _call(request, "add_file", content, file.filename or "upload", purpose,
                       expires)


@routes.get("/v1/files")
async def list_files(request: Request, purpose: str | None = None,
                     limit: Annotated[int, Query(ge=1, le=LIST_LIMIT)] = LIST_LIMIT,
                     after: str | None = None, order: Literal["asc", "desc"] = "desc"):
    return _listing(*await _call(request, "files", purpose, limit, after, order == "desc"))


@routes.get("/v1/files/{file_id}")
async def retrieve_file(file_id: str, request: Request):
    return await _found(request, "file", file_id)


@routes.get("/v1/files/{file_id}/content")
async def file_content(file_id: str, request: Request):
    content = await _found(request, "content", file_id)
    return Response(content, media_type="application/octet-stream")


@routes.delete("/v1/files/{file_id}")
async def delete_file(file_id: str, request: Request):
    if not await _call(request, "delete_file", file_id):
        raise APIError(f"no file with id {file_id!r}", 404, code="not_found")
    return {"id": file_id, "object": "file", "deleted": True}


@routes.post("/v1/batches")
async def create_batch(body: BatchCreate, request: Request):
    """A batch over an uploaded `batch` file's lines; each line's url must be `endpoint`."""
    found = await _found(request, "file", body.input_file_id, "input_file_id")
    if found["purpose"] != "batch":
        raise APIError(f"the input file's purpose is {found['purpose']!r}; a batch reads a "
                       f"file uploaded with purpose 'batch'", param="input_file_id")
    content = await _found(request, "content", body.input_file_id, "input_file_id")
    try:  # up to --max-file-bytes: in a thread, as the store's calls
        lines = await asyncio.to_thread(
            lambda: [line for line in content.decode("utf-8").splitlines() if line.strip()])
    except UnicodeDecodeError as exc:
        raise APIError(f"the input file is not UTF-8 text: {exc}",
                       param="input_file_id") from exc
    if not 0 < len(lines) <= MAX_LINES:
        raise APIError(f"the input file holds {len(lines)} requests; a batch takes 1 to "
                       f"{MAX_LINES}", param="input_file_id")
    keep = _runner(request).file_seconds
    expiry = body.output_expires_after or (
        ExpiresAfter(anchor="created_at", seconds=keep) if keep else None)
    batch = await _call(request, "add_batch", {
        "endpoint": body.endpoint, "input_file_id": body.input_file_id,
        "completion_window": body.completion_window, "metadata": body.metadata,
        "output_expires_after": expiry and expiry.model_dump()},
        lines, WINDOWS[body.completion_window])
    _runner(request).changed()
    return batch


@routes.get("/v1/batches/{batch_id}")
async def retrieve_batch(batch_id: str, request: Request):
    return await _found(request, "batch", batch_id)


@routes.get("/v1/batches")
async def list_batches(request: Request, after: str | None = None,
                       limit: Annotated[int, Query(ge=1, le=100)] = 20):
    return _listing(*await _call(request, "batches", limit, after))


@routes.post("/v1/batches/{batch_id}/cancel")
async def cancel_batch(batch_id: str, request: Request):
    """Stop a batch: `cancelling` until its lines in flight are stopped, then `cancelled`
    with the answers it has."""
    moved = await _call(request, "set_status", batch_id, "cancelling",
                        ("validating", "in_progress"))
    if moved is not None:
        _runner(request).changed()
        return moved
    found = await _found(request, "batch", batch_id)
    if found["status"] in ("cancelling", "cancelled"):
        return found
    raise APIError(f"the batch is {found['status']}: only a validating or in-progress batch "
                   f"can be cancelled", 409, code="batch_not_cancellable")
