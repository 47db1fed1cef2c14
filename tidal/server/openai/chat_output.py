"""A chat choice's text, as it streams, into what the response carries: reasoning
(`reasoning.py`), content, and tool calls (`tool_parsers.py`), each piece once, the same
pieces whether streamed or collected into one message."""

from __future__ import annotations

import secrets
import string
import uuid
from dataclasses import dataclass, field
from typing import Callable

from tidal.server.openai.reasoning import Markers, ThinkSplitter
from tidal.server.openai.schemas import FunctionCall, FunctionDelta, ToolCall, ToolCallDelta
from tidal.server.openai.tool_parsers import Event, ToolParser


def openai_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def mistral_call_id() -> str:
    """Mistral's chat templates refuse any other tool call id than 9 letters and digits."""
    return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))


@dataclass(frozen=True)
class ChatOutputOptions:
    """How a request's choices are read: which tool parser (None: the text is content),
    whether a named function was forced (its finish reason stays "stop", as OpenAI's),
    one call at most unless `parallel`, the reasoning split, and how calls are named."""

    tool_parser: Callable[[], ToolParser] | None = None
    named: bool = False
    parallel: bool = True
    reasoning: Markers | None = None  # split blocks so marked into reasoning_content
    prompt_opens_thinking: bool = False
    include_reasoning: bool = True
    call_id: Callable[[], str] = openai_call_id  # a new call's id, as the template takes it
    role: str = "assistant"  # the answer's (--response-role), or the continued message's


@dataclass
class Piece:
    """What one step added to a choice."""

    reasoning: str = ""
    content: str = ""
    calls: list[ToolCallDelta] = field(default_factory=list)


class ChoiceOutput:
    """One choice's reasoning, content and calls so far; `feed` returns the new piece for a
    streamed delta (`last=True` with a choice's final text, or `finish()` after it)."""

    def __init__(self, options: ChatOutputOptions) -> None:
        self.options = options
        self._think = (ThinkSplitter(options.prompt_opens_thinking, options.reasoning)
                       if options.reasoning else None)
        self._tools = options.tool_parser() if options.tool_parser else None
        self.reasoning = ""
        self.content = ""
        self.calls: list[ToolCall] = []
        self._dropped = False  # the call in progress is past the one allowed

    def feed(self, text: str, last: bool = False) -> Piece:
        """What `text` adds; with `last`, also what the parsers held back until the end."""
        reasoning, content = self._think.feed(text) if self._think else ("", text)
        if last and self._think:
            more = self._think.finish()
            reasoning, content = reasoning + more[0], content + more[1]
        return self._piece(reasoning, content, last)

    def finish(self) -> Piece:
        return self.feed("", last=True)

    def finish_reason(self, reason: str | None) -> str | None:
        """Calls end a choice with "tool_calls" (a forced named function keeps "stop")."""
        if self.calls and reason == "stop" and not self.options.named:
            return "tool_calls"
        return reason

    def _piece(self, reasoning: str, content: str, last: bool) -> Piece:
        piece = Piece()
        if self.options.include_reasoning:
            piece.reasoning = reasoning
            self.reasoning += reasoning
        events: list[Event] = [("content", content)] if content else []
        if self._tools is not None:
            events = (self._tools.feed(content) if content else []) + \
                     (self._tools.finish() if last else [])
        for event in events:
            self._event(event, piece)
        return piece

    def _event(self, event: Event, piece: Piece) -> None:
        kind = event[0]
        if kind == "content":
            piece.content += event[1]
            self.content += event[1]
        elif kind == "call":
            self._dropped = bool(self.calls) and not self.options.parallel
            if self._dropped:
                return
            _, name, arguments = event
            call = ToolCall(self.options.call_id(), FunctionCall(name, arguments))
            piece.calls.append(ToolCallDelta(len(self.calls), call.id, "function",
                                             FunctionDelta(name, arguments)))
            self.calls.append(call)
        elif not self._dropped:  # more arguments of the last call
            self.calls[-1].function.arguments += event[1]
            piece.calls.append(ToolCallDelta(len(self.calls) - 1,
                                             function=FunctionDelta(arguments=event[1])))


class PieceEvents:
    """What turns a choice's pieces into an API's stream events (the Responses API's output
    items, Anthropic's content blocks), in the order a stream shows them: the arguments
    that continue the open call, then reasoning, then text, then new calls (a call's
    arguments hold no text). A subclass makes each kind of event and closes its open
    item."""

    def add(self, piece: Piece, logprobs: list | None = None) -> list[dict]:
        """A piece's events, in that order."""
        events: list[dict] = []
        going_on = 0
        while going_on < len(piece.calls) and piece.calls[going_on].id is None:
            events += self._arguments(piece.calls[going_on])
            going_on += 1
        if piece.reasoning:
            events += self._reasoning(piece.reasoning)
        if piece.content:
            events += self._content(piece.content, logprobs or [])
        for call in piece.calls[going_on:]:
            if call.id is not None:  # a new call
                events += self.close()
                events += self._new_call(call)
            events += self._arguments(call)
        return events

    def close(self) -> list[dict]:
        """The events that end the open item, if any."""
        raise NotImplementedError

    def _arguments(self, call: ToolCallDelta) -> list[dict]:
        raise NotImplementedError

    def _reasoning(self, text: str) -> list[dict]:
        raise NotImplementedError

    def _content(self, text: str, logprobs: list) -> list[dict]:
        raise NotImplementedError

    def _new_call(self, call: ToolCallDelta) -> list[dict]:
        raise NotImplementedError
