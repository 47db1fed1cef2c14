"""An answer that ends when its client leaves: a whole body's work is cancelled at the
hang-up (its update stream then aborts the requests and frees their blocks), as a stream's
is; and an update stream held until its first item (a refusal before it is a plain error,
not an event inside a 200 stream)."""

from __future__ import annotations

import asyncio
from typing import Any, Awaitable

from fastapi import Request
from fastapi.responses import Response

from tidal.server.openai.generation_bodies import Updates


async def after_first(updates: Updates) -> Updates:
    """`updates` once its first item is here (an APIError before then propagates)."""
    first = await anext(updates)

    async def chained() -> Updates:
        try:
            yield first
            async for item in updates:
                yield item
        finally:
            await updates.aclose()

    return chained()


async def unless_client_leaves(request: Request, work: Awaitable) -> Any:
    """A whole-body answer stops when its client disconnects first, as a stream does: the
    cancelled update stream aborts the requests and their blocks return at once."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(disconnected(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not task.done():
            task.cancel()
    try:
        return await task
    except asyncio.CancelledError:
        if not gone.done() or gone.cancelled():
            raise  # the server itself is cancelling this request
        return Response(status_code=499)  # nobody is left to read it


async def disconnected(request: Request) -> None:
    """Returns when the client hangs up (the body was read: receive() waits for that)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
