"""Tool calling, output side: a choice's text into content and calls, as it streams.

Each parser takes the text piece by piece (`feed`) and once more at the end (`finish`),
and answers with events: ("content", text), ("call", name, arguments) for a new call, and
("args", text) for more of the last call's arguments. A whole response is the same events
collected. Parsers for `tool_choice: auto` read what the model wrote (`hermes`:
`<tool_call>{"name": ..., "arguments": ...}</tool_call>`, as Qwen and Hermes models write;
`llama3_json`: `{"name": ..., "parameters": ...}` objects separated by `;`; `mistral`:
`[TOOL_CALLS]` and a JSON list, or `name[ARGS]{...}` per call; `pythonic`: a Python list
of calls with keyword arguments); parsers for
forced choices read the output that structured outputs constrained."""

from __future__ import annotations

import ast
import json
import re
from typing import Any, Sequence

Event = tuple  # ("content", text) | ("call", name, arguments) | ("args", text)


def _call(obj: Any, args_keys: tuple[str, ...]) -> tuple[str, str] | None:
    """(name, arguments JSON) of a decoded call object, or None if it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = next((obj[k] for k in args_keys if k in obj), {})
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return obj["name"], json.dumps(args, ensure_ascii=False)


class ToolParser:
    """Base: content goes out as it comes, except whitespace, held until more text
    follows (so the blank lines around calls do not become content)."""

    KEEPS_SPECIAL_TOKENS = False  # its markers are special tokens: their text must stay

    def __init__(self) -> None:
        self._blank = ""

    def feed(self, text: str) -> list[Event]:
        raise NotImplementedError

    def finish(self) -> list[Event]:
        return []

    def _content(self, text: str) -> list[Event]:
        if not text:
            return []
        if not text.strip():
            self._blank += text
            return []
        text, self._blank = self._blank + text, ""
        return [("content", text)]


class HermesParser(ToolParser):
    """`<tool_call>` JSON `</tool_call>` blocks anywhere in the text."""

    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def __init__(self) -> None:
        super().__init__()
        self._pending = ""
        self._inside = False

    def feed(self, text: str) -> list[Event]:
        self._pending += text
        events: list[Event] = []
        while True:
            if self._inside:
                end = self._pending.find(self.CLOSE)
                if end < 0:
                    return events
                body, self._pending = self._pending[:end], self._pending[end + len(self.CLOSE):]
                self._inside = False
                events += self._block(body, closed=True)
            else:
                start = self._pending.find(self.OPEN)
                if start < 0:  # keep back what may be the start of a tag
                    keep = partial_suffix(self._pending, self.OPEN)
                    cut = len(self._pending) - keep
                    events += self._content(self._pending[:cut])
                    self._pending = self._pending[cut:]
                    return events
                events += self._content(self._pending[:start])
                self._pending = self._pending[start + len(self.OPEN):]
                self._inside = True

    def finish(self) -> list[Event]:
        rest, self._pending = self._pending, ""
        if self._inside:  # an unclosed call (cut by max_tokens): a call if it parses
            return self._block(rest, closed=False)
        return self._content(rest)

    def _block(self, body: str, closed: bool) -> list[Event]:
        try:
            call = _call(json.loads(body), ("arguments", "parameters"))
        except ValueError:
            call = None
        if call is None:  # not a call after all: it stays text
            tail = self.CLOSE if closed else ""
            return self._content(f"{self.OPEN}{body}{tail}")
        return [("call", *call)]


class WholeReplyParser(ToolParser):
    """A reply that is all calls or all content, told by how it starts (after an optional
    `TAG`): calls open with `OPENER`, and are read whole at the end (`_calls`: None when
    they do not parse, and the reply is content after all); content streams."""

    TAG, END, OPENER = "", "", ""

    def __init__(self) -> None:
        super().__init__()
        self._text = ""
        self._mode: str | None = None  # "calls" or "content" once the reply's start shows it

    def feed(self, text: str) -> list[Event]:
        if self._mode == "content":
            return self._content(text)
        self._text += text
        if self._mode is None:
            head = self._text.lstrip().removeprefix(self.TAG).lstrip()
            if head and not self.TAG.startswith(head):  # the reply's start is here
                self._mode = "calls" if head.startswith(self.OPENER) else "content"
                if self._mode == "content":
                    text, self._text = self._text, ""
                    return self._content(text)
        return []

    def finish(self) -> list[Event]:
        text, self._text = self._text, ""
        body = text.strip().removeprefix(self.TAG).removesuffix(self.END).strip()
        calls = self._calls(body) if self._mode == "calls" else None
        return self._content(text) if calls is None else [("call", *c) for c in calls]

    def _calls(self, body: str) -> list[tuple[str, str]] | None:
        raise NotImplementedError


class Llama3JsonParser(WholeReplyParser):
    """A reply that is JSON call objects (after an optional `<|python_tag|>`), separated by
    `;`; any other reply is content."""

    TAG, OPENER = "<|python_tag|>", "{"

    def _calls(self, body: str) -> list[tuple[str, str]] | None:
        decoder, calls, i = json.JSONDecoder(), [], 0
        try:
            while i < len(body):
                while i < len(body) and body[i] in " \t\n;":
                    i += 1
                if i == len(body):
                    break
                obj, i = decoder.raw_decode(body, i)
                call = _call(obj, ("parameters", "arguments"))
                if call is None:
                    return None
                calls.append(call)
        except ValueError:
            return None
        return calls


class MistralParser(ToolParser):
    """Mistral's calls after its `[TOOL_CALLS]` token: a JSON list of {name, arguments}
    (its v3 tokenizer's models, e.g. Mistral-7B-Instruct-v0.3), or `name[ARGS]{...}` per
    call, each after its own `[TOOL_CALLS]` (v11 on: Mistral Small 3.2, Magistral, Devstral).
    The text before the first marker is content; a reply whose calls do not parse stays
    text. The marker is a special token: requests read with it keep special tokens' text
    (KEEPS_SPECIAL_TOKENS), as vLLM's parser does."""

    BOT, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
    KEEPS_SPECIAL_TOKENS = True

    def __init__(self) -> None:
        super().__init__()
        self._pending = ""
        self._calls: str | None = None  # the text after the first marker, once it came

    def feed(self, text: str) -> list[Event]:
        if self._calls is not None:
            self._calls += text
            return []
        self._pending += text
        start = self._pending.find(self.BOT)
        if start >= 0:
            content, self._calls = self._pending[:start], self._pending[start:]
            self._pending = ""
            return self._content(content)
        cut = len(self._pending) - partial_suffix(self._pending, self.BOT)
        content, self._pending = self._pending[:cut], self._pending[cut:]
        return self._content(content)

    def finish(self) -> list[Event]:
        text, self._calls = self._calls, None
        if text is None:
            rest, self._pending = self._pending, ""
            return self._content(rest)
        calls = self._parse(text)
        return self._content(text) if calls is None else [("call", *c) for c in calls]

    def _parse(self, text: str) -> list[tuple[str, str]] | None:
        parts = [p.strip() for p in text.split(self.BOT)[1:]]
        try:
            if parts and parts[0].startswith(("[", "{")):  # one JSON list (or object)
                if len(parts) != 1:
                    return None
                objs = json.loads(parts[0])
                calls = [_call(o, ("arguments", "parameters"))
                         for o in (objs if isinstance(objs, list) else [objs])]
            else:
                calls = [self._named(p) for p in parts]
        except ValueError:
            return None
        return None if not calls or None in calls else calls  # type: ignore[return-value]

    def _named(self, part: str) -> tuple[str, str] | None:
        """`name[ARGS]{...}` (or `name[CALL_ID]id[ARGS]{...}`) as (name, arguments)."""
        head, sep, args = part.partition(self.ARGS)
        name = head.partition(self.CALL_ID)[0].strip()
        if not sep or not name:
            return None
        return _call({"name": name, "arguments": json.loads(args)}, ("arguments",))


class PythonicParser(WholeReplyParser):
    """A reply that is a Python list of calls, `[get_weather(city="Paris"), f()]` (Llama
    3.2 and 4 with their pythonic templates; Llama 4 wraps it in `<|python_start|>` and
    `<|python_end|>`): keyword arguments of literal values, read as Python's own parser
    reads them (never evaluated). Any other reply is content."""

    TAG, END, OPENER = "<|python_start|>", "<|python_end|>", "["

    def _calls(self, body: str) -> list[tuple[str, str]] | None:
        try:
            tree = ast.parse(body, mode="eval").body
            if not isinstance(tree, ast.List) or not tree.elts:
                return None
            calls = []
            for node in tree.elts:
                if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                        and not node.args and all(k.arg for k in node.keywords)):
                    return None
                args = {k.arg: ast.literal_eval(k.value) for k in node.keywords}
                calls.append((node.func.id, json.dumps(args, ensure_ascii=False)))
            return calls
        except (SyntaxError, ValueError, TypeError, RecursionError, MemoryError):
            return None  # not literal Python calls (or nested past the parser's depth)


class NamedCallParser(ToolParser):
    """A forced function: the whole output is its arguments, streamed as they come."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self._name: str | None = name

    def feed(self, text: str) -> list[Event]:
        events: list[Event] = []
        if self._name is not None:
            events.append(("call", self._name, ""))
            self._name = None
        return events + [("args", text)] if text else events

    def finish(self) -> list[Event]:
        return self.feed("")


class RequiredCallsParser(ToolParser):
    """`tool_choice: required`: the output is a JSON list of {name, arguments} calls, each
    name one of `names` (the request's tools)."""

    def __init__(self, names: Sequence[str] = ()) -> None:
        super().__init__()
        self._text, self._names = "", names

    def feed(self, text: str) -> list[Event]:
        self._text += text
        return []

    def finish(self) -> list[Event]:
        try:
            objs = json.loads(self._text)
            calls = [_call(o, ("arguments",)) for o in objs]
        except ValueError:  # cut short by max_tokens: OpenAI's shape is the calls so far,
            # the last one unfinished
            return [("call", *c) for c in _cut_calls(self._text, self._names)]
        except TypeError:
            calls = [None]
        if not calls or None in calls:
            return self._content(self._text)
        return [("call", *c) for c in calls]


_CUT_CALL = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")(?:\s*,\s*"arguments"\s*:\s*(.*))?',
                       re.S)


_CUT_NAME = re.compile(r'"name"\s*:\s*"((?:[^"\\]|\\.)*)$', re.S)


def _cut_calls(text: str, names: Sequence[str]) -> list[tuple[str, str]]:
    """The calls of a `required` list cut short: each whole one, then the last with its
    name and its arguments as far as they were generated. A call cut before its name ended
    (or before the list's first call began: it holds one at least) is named when exactly
    one of the tools' `names` begins as far as it came, as a forced named call would be."""
    decoder, calls, begun = json.JSONDecoder(), [], None
    at = text.find("[") + 1
    while 0 < at < len(text):
        at = len(text) - len(text[at:].lstrip(", \t\r\n"))
        try:
            obj, at = decoder.raw_decode(text, at)
        except ValueError:
            cut = _CUT_CALL.match(text, at)
            if cut is not None:
                calls.append((json.loads(cut[1]), cut[2] or ""))
            else:
                name_cut = _CUT_NAME.search(text, at)
                begun = name_cut[1] if name_cut else ""
            break
        calls.append(_call(obj, ("arguments",)))
    if begun is not None or not calls:
        fits = [n for n in names
                if json.dumps(n, ensure_ascii=False)[1:-1].startswith(begun or "")]
        if len(fits) == 1:
            calls.append((fits[0], ""))
    return calls


def partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


AUTO_PARSERS = {"hermes": HermesParser, "llama3_json": Llama3JsonParser,
                "mistral": MistralParser, "pythonic": PythonicParser}


def parser_for_template(template_source: str | None) -> str:
    """The auto parser that matches a chat template: Mistral's where it writes
    `[TOOL_CALLS]`, pythonic where it asks for `[func_name1(...)]` lists (Llama 3.2's and
    4's pythonic templates) or writes `<|python_start|>`, Llama 3's JSON calls where it
    speaks of `<|python_tag|>` or ipython, else Hermes (also what tidal's own tool prompt
    asks for, for templates without tools)."""
    source = template_source or ""
    if "[TOOL_CALLS]" in source:
        return "mistral"
    if "[func_name1(" in source or "<|python_start|>" in source:
        return "pythonic"
    if "<tool_call>" not in source and ("<|python_tag|>" in source or "ipython" in source):
        return "llama3_json"
    return "hermes"
