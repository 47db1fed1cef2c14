"""Anthropic's Messages API: `POST /v1/messages` (whole or streamed) and
`POST /v1/messages/count_tokens`. A request runs as the chat request it translates into
(`request.py`); its answer is shaped by `output.py`; its errors take Anthropic's shape
(`protocol.py`). Clients send the key as `x-api-key` (errors.py accepts it)."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request

from tidal.server.anthropic.output import MessagesBody
from tidal.server.anthropic.request import MessagesRequest
from tidal.server.openai.protocol import APIError

routes = APIRouter()


@routes.post("/v1/messages")
async def create_message(body: MessagesRequest, request: Request):
    f = request.app.state.frontend
    f.check_model(body.model)
    f.check_task("generate")
    if body.max_tokens is None:
        raise APIError("max_tokens: Field required", param="max_tokens")
    chat = body.chat_request()
    prompts = await asyncio.to_thread(chat.prompt_ids, f.tokenizer)  # as in chat
    return await f.generate(MessagesBody, chat, prompts, request, options=f.chat_options(chat))


@routes.post("/v1/messages/count_tokens")
async def count_tokens(body: MessagesRequest, request: Request):
    """The prompt's tokens as /v1/messages would send them (system, messages and tools
    through the chat template)."""
    f = request.app.state.frontend
    f.check_model(body.model)
    chat = body.chat_request(stream=False)
    prompts = await asyncio.to_thread(chat.prompt_ids, f.tokenizer)
    return {"input_tokens": len(prompts[0])}
