"""A Responses API answer: the chat reader's pieces (reasoning, content, calls; see
`chat_output.py`) as output items, whole (stream=false) or as the documented stream of
events, `response.created` to `response.completed`. Both are made by the same
`OutputItems`, so a streamed response ends with the body a whole one would have."""

from __future__ import annotations

import time
import uuid
from typing import AsyncIterator, Callable

import msgspec

from tidal.server.openai import schemas as s
from tidal.server.openai.chat_output import ChoiceOutput, PieceEvents
from tidal.server.openai.protocol import APIError
from tidal.server.openai.generation_bodies import ChatResponse, Choice, Updates, token_entries
from tidal.server.responses.request import ResponsesRequest

_DELTA = {"message": "response.output_text", "reasoning": "response.reasoning_text"}


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class OutputItems(PieceEvents):
    """The response's output items as pieces arrive; `add` and `close` return the stream
    events they make. A message opens only at its first non-blank text (the blank text
    around tool calls makes no item)."""

    def __init__(self) -> None:
        self.items: list[dict] = []
        self._open: dict | None = None
        self._blank = ""  # leading whitespace, held until text follows it

    def _reasoning(self, text: str) -> list[dict]:
        return self._text("reasoning", text, [])

    def _content(self, text: str, logprobs: list) -> list[dict]:
        return self._text("message", text, logprobs)

    def _new_call(self, call) -> list[dict]:
        return self._start({"type": "function_call", "id": _id("fc"), "call_id": call.id,
                            "name": call.function.name, "arguments": "",
                            "status": "in_progress"})

    def _arguments(self, call) -> list[dict]:
        text = call.function.arguments if call.function is not None else None
        item = self._open
        if not text or item is None or item["type"] != "function_call":
            return []
        item["arguments"] += text
        return [{"type": "response.function_call_arguments.delta", "item_id": item["id"],
                 "output_index": len(self.items) - 1, "delta": text}]

    def close(self) -> list[dict]:
        """The events that end the open item, if any."""
        item, self._open = self._open, None
        if item is None:
            return []
        index, events = len(self.items) - 1, []
        item["status"] = "completed"
        if item["type"] == "function_call":
            events.append({"type": "response.function_call_arguments.done",
                           "item_id": item["id"], "output_index": index,
                           "name": item["name"], "arguments": item["arguments"]})
        else:
            part = item["content"][0]
            done = {"type": f"{_DELTA[item['type']]}.done", "item_id": item["id"],
                    "output_index": index, "content_index": 0, "text": part["text"]}
            if item["type"] == "message":
                done["logprobs"] = part["logprobs"]
            events += [done, {"type": "response.content_part.done", "item_id": item["id"],
                              "output_index": index, "content_index": 0, "part": part}]
        return events + [{"type": "response.output_item.done", "output_index": index,
                          "item": item}]

    def _start(self, item: dict) -> list[dict]:
        self._open, self._blank = item, ""  # blank text before another item belongs to none
        self.items.append(item)
        return [{"type": "response.output_item.added", "output_index": len(self.items) - 1,
                 "item": item}]

    def _text(self, kind: str, text: str, logprobs: list) -> list[dict]:
        events = []
        if self._open is None or self._open["type"] != kind:
            if kind == "message" and not (self._blank + text).strip():
                self._blank += text
                return []
            text, self._blank = self._blank + text, ""
            events += self.close()
            part = ({"type": "output_text", "text": "", "annotations": [], "logprobs": []}
                    if kind == "message" else {"type": "reasoning_text", "text": ""})
            item = ({"type": "message", "id": _id("msg"), "status": "in_progress",
                     "role": "assistant", "content": []} if kind == "message" else
                    {"type": "reasoning", "id": _id("rs"), "summary": [], "content": [],
                     "status": "in_progress"})
            events += self._start(item)
            item["content"].append(part)
            events.append({"type": "response.content_part.added", "item_id": item["id"],
                           "output_index": len(self.items) - 1, "content_index": 0,
                           "part": part})
        item = self._open
        part = item["content"][0]
        part["text"] += text
        delta = {"type": f"{_DELTA[kind]}.delta", "item_id": item["id"],
                 "output_index": len(self.items) - 1, "content_index": 0, "delta": text}
        if kind == "message":
            part["logprobs"] += logprobs
            delta["logprobs"] = logprobs
        return events + [delta]


class ResponseBody(ChatResponse):
    """POST /v1/responses: one choice read as a chat reply, answered as a Response object
    (or its events); `on_done` gets the finished object (the store keeps it)."""

    def __init__(self, *args, source: ResponsesRequest, sampled=None,
                 on_done: Callable[[dict], None] | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # `sampled`: the chat request it ran as, whose temperature and top_p (the body's, or
        # the model's defaults) the object echoes
        self.source, self.sampled, self.on_done = source, sampled or source, on_done
        self.id, self.created = _id("resp"), time.time()
        self.output = OutputItems()

    def final(self, choices: list[Choice]) -> dict:
        ch, reader = choices[0], self.outputs[0]
        self.output.add(reader.feed(ch.text, last=True), self._logprobs(ch.logprobs))
        self.output.close()
        return self._finished(ch, reader)

    async def events(self, updates: Updates, include_usage: bool) -> AsyncIterator[str]:
        seq = 0

        def event(body: dict) -> str:
            nonlocal seq
            body["sequence_number"], seq = seq, seq + 1
            return f"event: {body['type']}\ndata: {s.encode(body).decode()}\n\n"

        ch, reader = self.choices[0], self.outputs[0]
        try:
            yield event({"type": "response.created", "response": self.snapshot("in_progress")})
            yield event({"type": "response.in_progress",
                         "response": self.snapshot("in_progress")})
            async for _, u in self._prompt_entries_first(updates):
                ch.text += u.new_text
                ch.tokens.extend(u.new_token_ids)
                if u.finished:
                    ch.finish_reason, ch.message = u.finish_reason, u.finish_message
                piece = reader.feed(u.new_text, last=u.finished)
                for body in self.output.add(piece, self._logprobs(token_entries(u))):
                    yield event(body)
            for body in self.output.close():
                yield event(body)
            final = self._finished(ch, reader)
            kind = {"completed": "response.completed", "incomplete": "response.incomplete"}
            yield event({"type": kind.get(final["status"], "response.failed"),
                         "response": final})
        except APIError as exc:
            yield event({"type": "error", "code": exc.code, "message": exc.message,
                         "param": exc.param})
        finally:
            await updates.aclose()  # (the server then ends the requests: Submission.end)

    def _logprobs(self, entries) -> list:
        """The entries of the text's tokens: a special token (the end of turn that stopped
        the answer) is no text, so it has none, whole or streamed."""
        if not self.want_logprobs:
            return []
        text, raw = self.token_text, self.token_bytes
        return [{"token": text(t), "logprob": e.logprob, "bytes": raw(t),
                 "top_logprobs": [{"token": text(a), "logprob": alp, "bytes": raw(a)}
                                  for a, alp in e.top]} for t, e in entries
                if self.tokenizer.decode([t]) or not text(t)]

    def _finished(self, ch: Choice, reader: ChoiceOutput) -> dict:
        status, details, error = "completed", None, None
        if ch.finish_reason == "length":
            status, details = "incomplete", {"reason": "max_output_tokens"}
        elif ch.finish_reason == "error":
            status, error = "failed", {"code": "server_error",
                                       "message": ch.message or "generation failed"}
        body = self.snapshot(status, output=self.output.items)
        body.update(incomplete_details=details, error=error, usage=self._usage())
        if self.on_done is not None and status != "failed":
            self.on_done(body)
        return body

    def _usage(self) -> dict:
        u = self.usage()
        details = u.completion_tokens_details
        reasoning = 0 if details is msgspec.UNSET else details.reasoning_tokens
        return {"input_tokens": u.prompt_tokens,
                "input_tokens_details": {"cached_tokens": u.prompt_tokens_details.cached_tokens},
                "output_tokens": u.completion_tokens,
                "output_tokens_details": {"reasoning_tokens": reasoning},
                "total_tokens": u.total_tokens}

    def snapshot(self, status: str, output: list | None = None) -> dict:
        """The Response object: what was asked for, echoed, and the output so far."""
        req = self.source
        return {
            "id": self.id, "object": "response", "created_at": self.created,
            "status": status, "background": req.background, "error": None,
            "incomplete_details": None, "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens, "max_tool_calls": req.max_tool_calls,
            "model": self.model_name,
            "output": list(output or []), "parallel_tool_calls": req.parallel_tool_calls,
            "previous_response_id": req.previous_response_id,
            "reasoning": {"effort": None, "summary": None}, "store": req.store,
            "temperature": self.sampled.temperature, "text": {"format": req.text_format()},
            "tool_choice": req.tool_choice or "auto", "tools": req.tools or [],
            "top_logprobs": req.top_logprobs or 0, "top_p": self.sampled.top_p,
            "truncation": req.truncation or "disabled", "usage": None, "user": req.user,
            "metadata": req.metadata or {}}
