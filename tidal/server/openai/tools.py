"""Tool calling, request side: the `tools` and `tool_choice` of a chat request, the output
constraint that enforces `required` and named choices (structured outputs), and the
conversation as the chat template sees it (tools, assistant `tool_calls`, `tool` results).

A template that reads `tools` renders them itself. One that does not gets them in the
system message in the Hermes format (`<tools>` signatures, `<tool_call>` replies,
`<tool_response>` results), which the `hermes` parser reads back."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import Field

from tidal.model.chat_template import shaped_content
from tidal.server.openai.protocol import StrictModel, refuse
from tidal.server.openai.structured import closed_objects


class FunctionDefinition(StrictModel):
    """A function the model may call: its parameters are a JSON schema."""

    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # calls are always checked against the schema when forced


class Tool(StrictModel):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(StrictModel):
    name: str


class NamedToolChoice(StrictModel):
    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


def tool_dicts(tools: list[Tool] | None) -> list[dict] | None:
    """The tools as the chat template sees them (OpenAI's JSON, nulls left out)."""
    return [t.model_dump(exclude_none=True) for t in tools] if tools else None


def arguments_schema(tool: Tool) -> dict:
    """What a forced call's arguments must match: the parameters, with undeclared
    properties refused unless the schema allows them (`closed_objects`)."""
    return closed_objects(tool.function.parameters or {"type": "object", "properties": {}})


def tool_constraint(tools: list[Tool], choice: ToolChoice, parallel: bool
                    ) -> tuple[str, str] | None:
    """The JSON schema a forced choice's output must follow: a named function's arguments,
    or for `required` a list of {name, arguments} calls (one at most unless parallel)."""
    if isinstance(choice, NamedToolChoice):
        tool = next((t for t in tools if t.function.name == choice.function.name), None)
        if tool is None:
            raise refuse("tool_choice.function.name",
                         f"tool_choice names {choice.function.name!r}, which is not in tools")
        return "json", json.dumps(arguments_schema(tool))
    if choice != "required":
        return None
    calls = [{"type": "object", "additionalProperties": False,
              "required": ["name", "arguments"],
              "properties": {"name": {"const": t.function.name},
                             "arguments": arguments_schema(t)}} for t in tools]
    schema = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if not parallel:
        schema["maxItems"] = 1
    return "json", json.dumps(schema)


def call_text(name: str, arguments: str) -> str:
    """A call in the Hermes format, as a template without tool support shows it."""
    return f'<tool_call>\n{{"name": {json.dumps(name)}, "arguments": {arguments}}}\n</tool_call>'


def _tools_system_text(tools: list[dict]) -> str:
    signatures = "\n".join(json.dumps(t) for t in tools)
    return ("You may call one or more functions to answer. Their signatures are within "
            f"<tools></tools>:\n<tools>\n{signatures}\n</tools>\n"
            "To call a function, reply with a JSON object holding its name and arguments "
            "within <tool_call></tool_call> tags:\n<tool_call>\n"
            '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')


def _text(message: dict) -> str:
    """A template message's content as text (its text parts joined)."""
    return shaped_content(message.get("content"), "string") or ""


def template_conversation(messages: list[dict], tools: list[dict] | None,
                          native: bool) -> tuple[list[dict], list[dict] | None]:
    """(messages, tools) for the chat template. `native`: the template reads tools and
    tool calls itself (assistant arguments become objects, as templates expect); otherwise
    tools join the system message and calls and results become Hermes-format text."""
    if native:
        out = []
        for m in messages:
            if m.get("tool_calls"):
                calls = [{**c, "function": {**c["function"],
                                            "arguments": json.loads(c["function"]["arguments"])}}
                         for c in m["tool_calls"]]
                m = {**m, "tool_calls": calls}
            out.append(m)
        return out, tools
    out = []
    for m in messages:
        if m["role"] == "tool":
            m = {"role": "user",
                 "content": f"<tool_response>\n{_text(m)}\n</tool_response>"}
        elif m.get("tool_calls"):
            calls = "\n".join(call_text(c["function"]["name"], c["function"]["arguments"])
                              for c in m["tool_calls"])
            text = _text(m)
            m = {"role": m["role"], "content": f"{text}\n{calls}" if text else calls}
        out.append(m)
    if tools:
        text = _tools_system_text(tools)
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{_text(out[0])}\n\n{text}"}
        else:
            out.insert(0, {"role": "system", "content": text})
    return out, None
