"""OpenAI response bodies. One class per endpoint (ChatResponse, CompletionResponse) says how
its choices, deltas and logprobs look; their base turns a request's token updates into the
final JSON (stream=false) or the SSE chunks (stream=true)."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import AsyncGenerator, AsyncIterator

from tidal.engine.outputs import StepUpdate
from tidal.server.protocol import APIError

# (choice index, update) until every choice finished; raises APIError when the request fails
Updates = AsyncGenerator[tuple[int, StepUpdate], None]


def sse(obj) -> str:
    return f"data: {json.dumps(obj)}\n\n"


@dataclass
class _Choice:
    text: str = ""
    tokens: list[int] = field(default_factory=list)
    logprobs: list = field(default_factory=list)  # (token, (logprob, alternatives)) entries
    finish_reason: str | None = None
    message: str | None = None


def _entries(u: StepUpdate) -> list:
    return list(zip(u.new_token_ids, u.logprobs or []))


class GenerationResponse:
    """What chat and completions share: the envelope (id, object, created, model), the
    choices as they accumulate, usage, and the loops over the updates. Subclasses fill in
    the endpoint's own shapes."""

    id_prefix = ""
    object = ""
    chunk_object = ""

    def __init__(self, tokenizer, model_name: str, request_id: str, prompts: list[list[int]],
                 num_choices: int, logprobs: bool, token_bytes=None) -> None:
        self.tokenizer, self.model_name, self.prompts = tokenizer, model_name, prompts
        self.id, self.created = f"{self.id_prefix}-{request_id}", int(time.time())
        self.choices = [_Choice() for _ in range(num_choices)]
        self.want_logprobs = logprobs
        # a token's own bytes (a partial UTF-8 character stays partial); else its text's
        self._token_bytes = token_bytes

    # ------------------------------------------------------------------ per endpoint
    def logprobs(self, entries: list, offset: int) -> dict:
        raise NotImplementedError

    def content(self, text: str) -> dict:
        """A finished choice's text, in the final body."""
        raise NotImplementedError

    def delta(self, text: str) -> dict:
        """New text, in a streamed chunk."""
        raise NotImplementedError

    def opening(self) -> list[dict]:
        """Choices of a chunk sent before any token (none unless the endpoint wants one)."""
        return []

    # ------------------------------------------------------------------ shared
    def token_text(self, t: int) -> str:
        return self.tokenizer.decode([t], skip_special_tokens=False)

    def token_bytes(self, t: int) -> list[int]:
        raw = self._token_bytes(t) if self._token_bytes else self.token_text(t).encode()
        return list(raw)

    def usage(self) -> dict:
        p = sum(len(ids) for ids in self.prompts)  # once per prompt, whatever n is
        c = sum(len(ch.tokens) for ch in self.choices)
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}

    def chunk(self, choices: list[dict], **extra) -> str:
        return sse({"id": self.id, "object": self.chunk_object, "created": self.created,
                    "model": self.model_name, "choices": choices, **extra})

    async def body(self, updates: Updates) -> dict:
        """The whole response once every choice finished (stream=false)."""
        async for i, u in updates:
            ch = self.choices[i]
            ch.text += u.new_text
            ch.tokens.extend(u.new_token_ids)
            ch.logprobs.extend(_entries(u))
            if u.finished:
                ch.finish_reason, ch.message = u.finish_reason, u.finish_message
        for ch in self.choices:
            if ch.finish_reason == "error":
                raise APIError(ch.message or "generation failed", 500, "internal_error")
        out = []
        for i, ch in enumerate(self.choices):
            lp = self.logprobs(ch.logprobs, 0) if self.want_logprobs else None
            out.append({"index": i, "logprobs": lp, "finish_reason": ch.finish_reason,
                        **self.content(ch.text)})
        return {"id": self.id, "object": self.object, "created": self.created,
                "model": self.model_name, "choices": out, "usage": self.usage()}

    async def events(self, updates: Updates, include_usage: bool) -> AsyncIterator[str]:
        """SSE chunks as tokens come, errors as error bodies, then [DONE] (stream=true)."""
        try:
            opening = self.opening()
            if opening:
                yield self.chunk(opening)
            async for i, u in updates:
                ch = self.choices[i]
                lp = self.logprobs(_entries(u), len(ch.text)) if self.want_logprobs else None
                ch.text += u.new_text
                ch.tokens.extend(u.new_token_ids)
                if u.finish_reason == "error":
                    yield sse(APIError(u.finish_message or "generation failed", 500,
                                       "internal_error").body())
                    continue
                if not (u.new_text or u.finished or lp):
                    continue
                part = {"index": i, "logprobs": lp,
                        "finish_reason": u.finish_reason if u.finished else None,
                        **self.delta(u.new_text)}
                yield self.chunk([part], **({"usage": None} if include_usage else {}))
            if include_usage:
                yield self.chunk([], usage=self.usage())
        except APIError as exc:
            yield sse(exc.body())
        finally:
            await updates.aclose()  # a closed connection lands here: abort at once
        yield "data: [DONE]\n\n"


class ChatResponse(GenerationResponse):
    """/v1/chat/completions: messages, role-then-content deltas, per-token logprob content."""

    id_prefix = "chatcmpl"
    object = "chat.completion"
    chunk_object = "chat.completion.chunk"

    def logprobs(self, entries: list, offset: int) -> dict:
        text = self.token_text
        return {"content": [{
            "token": text(t), "logprob": lp, "bytes": self.token_bytes(t),
            "top_logprobs": [{"token": text(a), "logprob": alp, "bytes": self.token_bytes(a)}
                             for a, alp in alts]}
            for t, (lp, alts) in entries]}

    def content(self, text: str) -> dict:
        return {"message": {"role": "assistant", "content": text}}

    def delta(self, text: str) -> dict:
        return {"delta": {"content": text} if text else {}}

    def opening(self) -> list[dict]:
        return [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                 "finish_reason": None} for i in range(len(self.choices))]


class CompletionResponse(GenerationResponse):
    """/v1/completions: text choices and the legacy logprobs shape with text offsets."""

    id_prefix = "cmpl"
    object = "text_completion"
    chunk_object = "text_completion"

    def logprobs(self, entries: list, offset: int) -> dict:
        tokens, lps, tops, offsets = [], [], [], []
        for t, (lp, alts) in entries:
            text = self.token_text(t)
            tokens.append(text)
            lps.append(lp)
            tops.append({self.token_text(a): alp for a, alp in alts})
            offsets.append(offset)
            offset += len(text)
        return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops,
                "text_offset": offsets}

    def content(self, text: str) -> dict:
        return {"text": text}

    def delta(self, text: str) -> dict:
        return {"text": text}
