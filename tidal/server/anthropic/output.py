"""An Anthropic Messages answer: the chat reader's pieces (reasoning, content, calls; see
`chat_output.py`) as content blocks (thinking, text, tool_use), whole (stream=false) or as
Anthropic's stream of events, `message_start` to `message_stop`. Both are made by the same
`ContentBlocks`, so a streamed message carries the blocks a whole one would have."""

from __future__ import annotations

import json
import uuid
from typing import AsyncIterator

from tidal.server.anthropic.protocol import error_body
from tidal.server.openai import schemas as s
from tidal.server.openai.chat_output import ChoiceOutput, PieceEvents
from tidal.server.openai.generation_bodies import ChatResponse, Choice, Updates
from tidal.server.openai.protocol import APIError

_DELTA = {"thinking": "thinking_delta", "text": "text_delta"}


def _input(arguments: str) -> dict:
    """A call's arguments as tool_use input: the JSON object it holds ({} for none, and for
    text that is no JSON object: a model's malformed call)."""
    try:
        value = json.loads(arguments) if arguments.strip() else {}
    except json.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


class ContentBlocks(PieceEvents):
    """The message's content blocks as pieces arrive; `add` and `close` return the stream
    events they make. A text block opens only at its first non-blank text (the blank text
    around tool calls makes no block)."""

    def __init__(self) -> None:
        self.blocks: list[dict] = []
        self._open: dict | None = None
        self._json = ""  # the open tool_use block's JSON so far
        self._blank = ""  # leading whitespace, held until text follows it

    def _reasoning(self, text: str) -> list[dict]:
        return self._text("thinking", text)

    def _content(self, text: str, logprobs: list) -> list[dict]:
        return self._text("text", text)

    def _new_call(self, call) -> list[dict]:
        return self._start({"type": "tool_use", "id": call.id, "name": call.function.name,
                            "input": {}})

    def close(self) -> list[dict]:
        """The events that end the open block, if any."""
        block, self._open = self._open, None
        if block is None:
            return []
        index, events = len(self.blocks) - 1, []
        if block["type"] == "tool_use":
            block["input"] = _input(self._json)
        elif block["type"] == "thinking":  # no signature: nothing here signs reasoning
            events.append({"type": "content_block_delta", "index": index,
                           "delta": {"type": "signature_delta", "signature": ""}})
        return events + [{"type": "content_block_stop", "index": index}]

    def _arguments(self, call) -> list[dict]:
        text = call.function.arguments if call.function is not None else None
        if not text or self._open is None or self._open["type"] != "tool_use":
            return []
        self._json += text
        return [{"type": "content_block_delta", "index": len(self.blocks) - 1,
                 "delta": {"type": "input_json_delta", "partial_json": text}}]

    def _start(self, block: dict) -> list[dict]:
        self._open, self._blank, self._json = block, "", ""
        self.blocks.append(block)
        start = dict(block)
        if block["type"] != "tool_use":  # the block starts empty; deltas fill it
            start[block["type"]] = ""
        return [{"type": "content_block_start", "index": len(self.blocks) - 1,
                 "content_block": start}]

    def _text(self, kind: str, text: str) -> list[dict]:
        events = []
        if self._open is None or self._open["type"] != kind:
            if kind == "text" and not (self._blank + text).strip():
                self._blank += text
                return []
            text, self._blank = self._blank + text, ""
            events += self.close()
            events += self._start({"type": "thinking", "thinking": "", "signature": ""}
                                  if kind == "thinking" else {"type": "text", "text": ""})
        self._open[kind] += text
        return events + [{"type": "content_block_delta", "index": len(self.blocks) - 1,
                          "delta": {"type": _DELTA[kind], kind: text}}]


class MessagesBody(ChatResponse):
    """POST /v1/messages: one choice read as a chat reply, answered as a Message object (or
    its events)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.id = f"msg_{uuid.uuid4().hex}"
        self.content = ContentBlocks()

    def final(self, choices: list[Choice]) -> dict:
        ch, reader = choices[0], self.outputs[0]
        self.content.add(reader.feed(ch.text, last=True))
        self.content.close()
        return self._message(self.content.blocks, *self._stop(ch, reader),
                             len(ch.tokens))

    async def events(self, updates: Updates, include_usage: bool) -> AsyncIterator[str]:
        def event(body: dict) -> str:
            return f"event: {body['type']}\ndata: {s.encode(body).decode()}\n\n"

        ch, reader = self.choices[0], self.outputs[0]
        ordered = self._prompt_entries_first(updates)
        try:
            # message_start waits for the first token: by then the prompt's cache hit is known
            first = await anext(ordered, None)
            yield event({"type": "message_start",
                         "message": self._message([], None, None, 0)})
            yield event({"type": "ping"})
            async for _, u in _after(first, ordered):
                if u.finish_reason == "error":
                    raise APIError(u.finish_message or "generation failed", 500,
                                   "internal_error")
                ch.text += u.new_text
                ch.tokens.extend(u.new_token_ids)
                if u.finished:
                    ch.finish_reason, ch.stop_string = u.finish_reason, u.stop_string
                for body in self.content.add(reader.feed(u.new_text, last=u.finished)):
                    yield event(body)
            for body in self.content.close():
                yield event(body)
            reason, sequence = self._stop(ch, reader)
            yield event({"type": "message_delta",
                         "delta": {"stop_reason": reason, "stop_sequence": sequence},
                         "usage": {**self._input_usage(), "output_tokens": len(ch.tokens)}})
            yield event({"type": "message_stop"})
        except APIError as exc:
            yield event(error_body(exc))
        finally:
            await updates.aclose()  # (the server then ends the requests: Submission.end)

    @staticmethod
    def _stop(ch: Choice, reader: ChoiceOutput) -> tuple[str, str | None]:
        """Anthropic's stop_reason and stop_sequence for the choice's end."""
        reason = reader.finish_reason(ch.finish_reason)
        if reason == "length":
            return "max_tokens", None
        if reason == "tool_calls" or (reader.calls and reader.options.named):
            return "tool_use", None
        if ch.stop_string is not None:
            return "stop_sequence", ch.stop_string
        return "end_turn", None

    def _message(self, content: list, reason: str | None, sequence: str | None,
                 output_tokens: int) -> dict:
        return {"id": self.id, "type": "message", "role": "assistant",
                "model": self.model_name, "content": content, "stop_reason": reason,
                "stop_sequence": sequence,
                "usage": {**self._input_usage(), "output_tokens": output_tokens}}

    def _input_usage(self) -> dict:
        """The prompt's tokens as Anthropic counts them: those read from the prefix cache
        apart from the rest."""
        cached = sum(self.cached)
        return {"input_tokens": sum(map(len, self.prompts)) - cached,
                "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached}


async def _after(first, rest):
    """`first` (unless None), then what `rest` yields."""
    if first is not None:
        yield first
    async for item in rest:
        yield item
