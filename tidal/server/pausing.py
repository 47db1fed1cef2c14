"""Pausing generation, as RL trainers do to swap a policy's weights between rollouts:
vLLM's `POST /pause`, `POST /resume` and `GET /is_paused` here, SGLang's
`/pause_generation` and `/continue_generation` in `sglang/routes.py`, both through `pause`;
and sleeping, to lend the machine's memory to a trainer between rollouts: vLLM's
`POST /sleep`, `POST /wake_up`, `GET /is_sleeping` here, SGLang's
`/release_memory_occupation` and `/resume_memory_occupation` there.

While paused every new request waits, unsent, and goes on at the resume in the order it
came; meanwhile its client may leave, or /abort_request end it, as any other's. What happens to the requests in flight is the mode's: `abort` ends them now, each
answered with what it generated (finish reason `abort`); `wait` lets them finish before
the pause answers; `keep` stops the engine cores planning steps, so each waits where it is,
blocks and tokens kept, and goes on at the resume with the tokens it would have had.
Asleep, the engine cores are stopped (their processes end) and started again at the wake,
the model's weights read again; requests wait as while paused."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Query
from fastapi.responses import Response

from tidal.server.frontend import Frontend, FrontendDep
from tidal.server.openai.protocol import APIError

routes = APIRouter()

Mode = Literal["abort", "wait", "keep"]


def check_drainable(f: Frontend, waits: bool, param: str) -> None:
    """Refuse to wait for requests a pause in place holds: they cannot finish until it
    ends (`param` names the field that would end them instead)."""
    if waits and f.client.held_in_place:
        raise APIError("requests are held by a pause in place (mode keep) and cannot finish "
                       "until /resume; resume first, or abort them", param=param)


async def settle(f: Frontend, abort: bool, why: str) -> None:
    """With new requests held: end those in flight now, each answered with what it made
    (`abort`), or let them finish; return once none is left (the held ones wait on)."""
    client = f.client
    if abort:
        await f.in_flight.stop(None, why, held=False)
        if client.cores_paused:  # held in place, not generations (embeddings): fail them
            for rid in client.streams.sent_ids():
                client.streams.fail(rid, why, dead=True)
                await client.abort(rid)
    await client.drained()


async def pause(f: Frontend, mode: Mode, clear_cache: bool) -> None:
    """Pause the server in `mode` (see the module); with `clear_cache`, every core then
    forgets its cached prefixes (KV a new model's weights would not have made)."""
    check_drainable(f, mode == "wait", "mode")
    f.client.pause(cores=mode == "keep")
    if mode != "keep":
        await settle(f, mode == "abort", "generation paused")
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


async def sleep(f: Frontend, mode: Mode) -> None:
    """Hold new requests, settle those in flight (`mode` abort or wait), then stop every
    engine core: the model's and the KV pool's memory return to the machine until `wake`."""
    client = f.client
    async with client.weights_lock:
        if "sleep" in client.holds:
            return
        check_drainable(f, mode == "wait", "mode")
        client.hold("sleep")
        await settle(f, mode == "abort", "the engine went to sleep")
        client.sleep()


async def wake(f: Frontend) -> None:
    """Start the cores `sleep` stopped; new requests go on (unless paused)."""
    client = f.client
    async with client.weights_lock:
        if "sleep" not in client.holds:
            return
        why = await client.wake()
    if why is not None:
        raise APIError(f"the engine did not wake: {why}; it restarts under --restart-core",
                       503, "service_unavailable")


@routes.post("/sleep")
async def sleep_route(f: FrontendDep, level: Annotated[int, Query(ge=1, le=2)] = 1,
                      mode: Annotated[Literal["abort", "wait"], Query()] = "abort"):
    """vLLM's: free the engine's memory (weights and KV cache, at either `level`: the
    engine cores stop) until /wake_up; requests in flight are aborted (or, `mode=wait`,
    finished first), new ones wait."""
    await sleep(f, mode)
    return Response(status_code=200)


@routes.post("/wake_up")
async def wake_up_route(f: FrontendDep, tags: Annotated[
        list[Literal["weights", "kv_cache"]] | None, Query()] = None):
    """vLLM's: load the engine again (every part at once, whichever `tags` names)."""
    await wake(f)
    return Response(status_code=200)


@routes.get("/is_sleeping")
async def is_sleeping(f: FrontendDep):
    """vLLM's: whether the engine sleeps."""
    return {"is_sleeping": "sleep" in f.client.holds}
