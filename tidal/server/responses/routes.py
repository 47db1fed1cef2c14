"""OpenAI's Responses API: `POST /v1/responses` (whole, streamed, or in the background:
`background.py`), and `GET` / `DELETE /v1/responses/{id}` and `POST .../cancel` over the
server's in-memory store (`store.py`). A request runs as the chat request it translates
into (`request.py`); its answer is shaped by `output.py`."""

from __future__ import annotations

import asyncio

import msgspec
from fastapi import APIRouter, Request
from fastapi.responses import Response

from tidal.server.openai.protocol import APIError
from tidal.server.responses.background import BackgroundResponses
from tidal.server.responses.output import ResponseBody
from tidal.server.responses.request import ResponsesRequest

routes = APIRouter()


def not_stored(response_id: str, param: str | None = None) -> APIError:
    """The 404 for a response id no store holds (here, or behind the P/D router)."""
    return APIError(f"no stored response with id {response_id!r} (unknown, deleted, or "
                    f"expired)", 404, param=param, code="response_not_found")


def _stored(request: Request, response_id: str, param: str | None = None):
    entry = request.app.state.frontend.responses.get(response_id)
    if entry is None:
        raise not_stored(response_id, param)
    return entry


def _background(request: Request) -> BackgroundResponses:
    """The app's background responses (made on first use)."""
    state = request.app.state
    if getattr(state, "background_responses", None) is None:
        state.background_responses = BackgroundResponses(state.frontend.responses)
    return state.background_responses


@routes.post("/v1/responses")
async def create_response(body: ResponsesRequest, request: Request):
    f = request.app.state.frontend
    f.check_model(body.model)
    f.check_task("generate")
    history = []
    if body.previous_response_id is not None:
        history = _stored(request, body.previous_response_id, "previous_response_id").messages
        if history is None:  # a background response not (or never) finished
            raise APIError(f"the response {body.previous_response_id!r} has not completed: "
                           f"there is no conversation to continue", param="previous_response_id")
    # (the conversation is kept whole for its successors, truncated or not)
    chat, conversation, prompts = await asyncio.to_thread(  # in a thread, as in chat
        body.fitted, history, f.tokenizer, f.client.ready.max_model_len)

    def keep(response: dict) -> None:
        """The finished response and its conversation, for its successors."""
        reply = [item for item in response["output"] if item["type"] != "reasoning"]
        text = "".join(p["text"] for item in reply if item["type"] == "message"
                       for p in item["content"])
        calls = [{"id": item["call_id"], "type": "function",
                  "function": {"name": item["name"], "arguments": item["arguments"]}}
                 for item in reply if item["type"] == "function_call"]
        message = {"role": "assistant", "content": text or None}
        if calls:
            message["tool_calls"] = calls
        f.responses.put(response["id"], msgspec.json.encode(response),
                        conversation + [message])

    options = dict(options=f.chat_options(chat), source=body, sampled=chat,
                   on_done=keep if body.store else None)
    if body.background:  # answered now, as queued; polled with GET, stopped with cancel
        return _background(request).run(*await f.start(ResponseBody, chat, prompts,
                                                       request.headers, **options))
    return await f.generate(ResponseBody, chat, prompts, request, **options)


@routes.get("/v1/responses/{response_id}")
async def get_response(response_id: str, request: Request):
    """A response created with store: true, as it was sent."""
    return Response(_stored(request, response_id).body, media_type="application/json")


@routes.post("/v1/responses/{response_id}/cancel")
async def cancel_response(response_id: str, request: Request):
    """A background response stopped where it is (one already finished: as it is)."""
    entry = _stored(request, response_id)
    if not msgspec.json.decode(entry.body).get("background"):
        raise APIError("only a response created with background: true can be cancelled",
                       param="response_id")
    await _background(request).cancel(response_id)
    return Response(_stored(request, response_id).body, media_type="application/json")


@routes.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, request: Request):
    _stored(request, response_id)
    await _background(request).cancel(response_id)  # a background one stops first
    request.app.state.frontend.responses.delete(response_id)
    return {"id": response_id, "object": "response.deleted", "deleted": True}
