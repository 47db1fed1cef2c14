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
# How a message's content reaches a template (vLLM's --chat-template-content-format):
# 'string' text, 'openai' a list of text parts, 'auto' what the template reads
CONTENT_FORMATS = ("auto", "string", "openai")


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


def _part_text(part) -> str:
    if not (isinstance(part, dict) and part.get("type") == "text"
            and isinstance(part.get("text"), str)):
        raise ValueError(f"content parts must be text parts ({{'type': 'text', 'text': ...}}; "
                         f"tidal serves text-only models), not {part!r:.80}")
    return part["text"]


def shaped_content(content, content_format: str):
    """A message's content as a template of `content_format` reads it: text (text parts
    joined with newlines, as the server joins them) or a list of text parts."""
    if content_format == "string":
        return "\n".join(map(_part_text, content)) if isinstance(content, list) else content
    if content is None:
        return []
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    return [{"type": "text", "text": _part_text(p)} for p in content]


def _loops_over_content(ast: jinja2.nodes.Template) -> bool:
    """Whether a template iterates over a message's content (`for part in
    message['content']`, or over a variable set from it): it reads lists of parts."""
    def content(node) -> bool:
        return (isinstance(node, jinja2.nodes.Getattr) and node.attr == "content") or (
            isinstance(node, jinja2.nodes.Getitem) and isinstance(node.arg, jinja2.nodes.Const)
            and node.arg.value == "content")

    names = {a.target.name for a in ast.find_all(jinja2.nodes.Assign)
             if isinstance(a.target, jinja2.nodes.Name) and content(a.node)}
    return any(content(f.iter) or (isinstance(f.iter, jinja2.nodes.Name)
                                   and f.iter.name in names)
               for f in ast.find_all(jinja2.nodes.For))


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
        # what 'auto' gives this template: lists of parts where it loops over content
        self.content_format = "openai" if _loops_over_content(env.parse(source)) else "string"

    def mentions(self, name: str) -> bool:
        """Whether the template reads a variable or field of that name (e.g. 'tools')."""
        return name in self.source

    def render(self, messages: list[dict], add_generation_prompt: bool = True,
               tools: list[dict] | None = None, documents: list[dict] | None = None,
               continue_final_message: bool = False, content_format: str = "auto",
               **kwargs) -> str:
        """The prompt text. `continue_final_message` ends it inside the last message (for
        the model to go on writing it), so no end-of-turn follows that message's text.
        Messages' content reaches the template as `content_format` says (CONTENT_FORMATS)."""
        for m in messages:
            if not isinstance(m, dict) or "role" not in m:
                raise ValueError("each message needs a 'role' (and 'content')")
        if content_format not in CONTENT_FORMATS:
            raise ValueError(f"content_format must be one of {', '.join(CONTENT_FORMATS)}; "
                             f"got {content_format!r}")
        if continue_final_message:
            final = shaped_content(messages[-1].get("content"), "string") if messages else None
            if not isinstance(final, str):
                raise ValueError("continue_final_message needs a final message with text")
            messages = [*messages[:-1], {**messages[-1], "content": final + _CONTINUE_TAG}]
        form = self.content_format if content_format == "auto" else content_format
        messages = [{**m, "content": shaped_content(m["content"], form)} if "content" in m
                    else m for m in messages]
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
