"""Pausing generation, as RL trainers do to swap a policy's weights between rollouts:
vLLM's `POST /pause`, `POST /resume` and `GET /is_paused` here, SGLang's
`/pause_generation` and `/continue_generation` in `sglang/routes.py`, both through `pause`.

While paused every new request waits, unsent, and goes on at the resume in the order it
came. What happens to the requests in flight is the mode's: `abort` ends them now, each
answered with what it generated (finish reason `abort`); `wait` lets them finish before
the pause answers; `keep` stops the engine cores planning steps, so each waits where it is,
blocks and tokens kept, and goes on at the resume with the tokens it would have had."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Query

from tidal.server.frontend import Frontend, FrontendDep
from tidal.server.openai.protocol import APIError

routes = APIRouter()

Mode = Literal["abort", "wait", "keep"]


async def pause(f: Frontend, mode: Mode, clear_cache: bool) -> None:
    """Pause the server in `mode` (see the module); with `clear_cache`, every core then
    forgets its cached prefixes (KV a new model's weights would not have made)."""
    if mode == "wait" and f.client.held_in_place:
        raise APIError("requests are held by a pause in place (mode keep) and cannot finish "
                       "until /resume; pause with mode abort to end them", param="mode")
    f.client.pause(cores=mode == "keep")
    if mode == "abort":
        await f.in_flight.stop(None, "generation paused")
    elif mode == "wait":
        await f.client.drained()
    if clear_cache:
        f.client.reset_prefix_cache()


@routes.post("/pause")
async def pause_route(f: FrontendDep, mode: Annotated[Mode, Query()] = "abort",
                      wait_for_inflight_requests: bool = False, clear_cache: bool = True):
    """vLLM's: hold new requests until /resume; the requests in flight are aborted
    (`mode=abort`, answered with what they have), finished first (`wait`, or the older
    `wait_for_inflight_requests=true`) or frozen in place (`keep`). Answers once paused."""
    if wait_for_inflight_requests and mode == "abort":
        mode = "wait"
    await pause(f, mode, clear_cache)
    return {"status": "paused"}


@routes.post("/resume")
async def resume_route(f: FrontendDep):
    """vLLM's: generate again; held requests go on in the order they came."""
    f.client.resume()
    return {"status": "resumed"}


@routes.get("/is_paused")
async def is_paused(f: FrontendDep):
    """vLLM's: whether the server is paused."""
    return {"is_paused": f.client.paused}
