"""The generation routes: OpenAI's completions and chat completions (streamed over SSE or
not) and embeddings, and vLLM's tokenize and detokenize. How a response looks is in
`openai/generation_bodies.py`, what a request may hold in `openai/protocol.py`; the
`Frontend` drives each request."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request

from tidal.server.frontend import FrontendDep
from tidal.server.openai.chat import ChatRequest, TokenizeRequest
from tidal.server.openai.embeddings import EmbeddingRequest
from tidal.server.openai.generation_bodies import ChatResponse, CompletionResponse
from tidal.server.openai.protocol import CompletionRequest, DetokenizeRequest, check_token_ids

routes = APIRouter()


@routes.post("/v1/completions")
async def completions(body: CompletionRequest, f: FrontendDep, request: Request):
    f.check_model(body.model)
    f.check_task("generate")
    # a body of --max-body-bytes takes seconds to tokenize; in a thread (the Rust tokenizer
    # lets go of the GIL) other requests keep streaming meanwhile
    prompts = await asyncio.to_thread(body.prompt_ids, f.tokenizer)
    return await f.generate(CompletionResponse, body, prompts, request, echo=body.echo,
                            sent=body.prompt_strings(), prompt_only=body.prompt_only)


@routes.post("/v1/chat/completions")
async def chat(body: ChatRequest, f: FrontendDep, request: Request):
    f.check_model(body.model)
    f.check_task("generate")
    f.check_chat_template(body.chat_template)
    prompts = await asyncio.to_thread(body.prompt_ids, f.tokenizer)  # as in completions
    return await f.generate(ChatResponse, body, prompts, request,
                            options=f.chat_options(body), echo=body.echoed())


@routes.post("/v1/embeddings")
async def embeddings(body: EmbeddingRequest, f: FrontendDep, request: Request):
    """OpenAI's: one pooled, normalised vector per input (the model's sentence-transformers
    pooling, else its last token's), batched with generation on the same cores."""
    f.check_model(body.model)
    f.check_task("embed")
    f.check_chat_template(body.chat_template)
    body.check_dimensions(f.client.ready.embedding_size, f.client.ready.matryoshka)
    prompts = await asyncio.to_thread(body.prompt_ids, f.tokenizer)  # as in completions
    return await f.embed(body, prompts, request)


@routes.post("/tokenize")
async def tokenize(body: TokenizeRequest, f: FrontendDep):
    """vLLM's: a prompt, or messages through the chat template, as token ids."""
    f.check_model(body.model)
    f.check_chat_template(body.chat_template)
    ids = await asyncio.to_thread(body.token_ids, f.tokenizer)  # as in completions
    out = {"tokens": ids, "count": len(ids), "max_model_len": f.client.ready.max_model_len}
    if body.return_token_strs:
        out["token_strs"] = f.tokenizer.token_strings(ids)
    return out


@routes.post("/detokenize")
async def detokenize(body: DetokenizeRequest, f: FrontendDep):
    """vLLM's: token ids back to text, special tokens included."""
    f.check_model(body.model)
    check_token_ids(body.tokens, f.client.ready.vocab_size, "tokens")
    text = await asyncio.to_thread(f.tokenizer.decode, body.tokens,  # as in completions
                                   skip_special_tokens=False)
    return {"prompt": text}
