"""A model's chat template, rendered the way transformers' `render_jinja_template` does:
a sandboxed jinja2 environment with the `loopcontrols` extension, the `{% generation %}`
tag, a `tojson` that neither escapes HTML nor sorts keys, `raise_exception`,
`strftime_now`, and the variables `messages`, `tools`, `documents`,
`add_generation_prompt`, the special tokens and any extra template arguments."""

from __future__ import annotations

import functools
import json
from datetime import datetime
from pathlib import Path

import jinja2
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

# Marks where a continued final message ends, to cut the rendering there.
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


class _Generation(Extension):
    """`{% generation %}...{% endgeneration %}` (training templates mark the assistant's
    tokens with it): rendered as its body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller) -> str:
        return caller()


def _raise(message: str):
    raise jinja2.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # jinja2's own tojson escapes <, > and & for HTML and sorts keys: prompts need neither
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


class ChatTemplate:
    """One compiled chat template; `render` turns a conversation into the prompt text."""

    def __init__(self, source: str, special_tokens: dict[str, str]) -> None:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[_Generation, loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals.update(raise_exception=_raise,
                           strftime_now=lambda fmt: datetime.now().strftime(fmt))
        self.source = source
        self.special_tokens = special_tokens
        self._template = env.from_string(source)

    def mentions(self, name: str) -> bool:
        """Whether the template reads a variable or field of that name (e.g. 'tools')."""
        return name in self.source

    def render(self, messages: list[dict], add_generation_prompt: bool = True,
               tools: list[dict] | None = None, documents: list[dict] | None = None,
               continue_final_message: bool = False, **kwargs) -> str:
        """The prompt text. `continue_final_message` ends it inside the last message (for
        the model to go on writing it), so no end-of-turn follows that message's text."""
        for m in messages:
            if not isinstance(m, dict) or "role" not in m:
                raise ValueError("each message needs a 'role' (and 'content')")
        if continue_final_message:
            if not messages or not isinstance(messages[-1].get("content"), str):
                raise ValueError("continue_final_message needs a final message with text")
            final = messages[-1]["content"]
            messages = [*messages[:-1], {**messages[-1], "content": final + _CONTINUE_TAG}]
        text = self._template.render(
            messages=messages, tools=tools, documents=documents,
            add_generation_prompt=add_generation_prompt,
            **{**self.special_tokens, **kwargs})
        if continue_final_message:
            end = text.rfind(_CONTINUE_TAG.strip())
            if end < 0 or final.strip() not in text:
                raise ValueError("the chat template does not write the final message's text, "
                                 "so it cannot be continued")
            # a template that strips the content also strips the tag's space: strip the cut
            kept = text[end:end + len(_CONTINUE_TAG)] == _CONTINUE_TAG
            text = text[:end] if kept else text[:end].rstrip()
        return text


def template_source(value: str) -> str:
    """vLLM's `--chat-template`: the template in a file at that path, or the text itself
    (it holds a brace or a newline, which no path of a template file does)."""
    path = Path(value).expanduser()
    if path.is_file():
        return path.read_text()
    if not any(c in value for c in "{}\n"):
        raise ValueError(f"chat template {value!r} is neither a file nor a template")
    return value


@functools.lru_cache(maxsize=32)
def compiled(source: str, special_tokens: tuple[tuple[str, str], ...]) -> ChatTemplate:
    """One compiled template per source and tokenizer (requests that send their own
    template reuse it); a syntax error raises jinja2.TemplateError."""
    return ChatTemplate(source, dict(special_tokens))
