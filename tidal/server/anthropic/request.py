"""Anthropic Messages request bodies (`POST /v1/messages`, `/v1/messages/count_tokens`),
served through the chat path: the system prompt and the messages' blocks become chat
messages (text joined, `tool_use` an assistant's tool calls, `tool_result` tool messages,
thinking blocks left out as the chat template shows no earlier reasoning), tools and
tool_choice chat tools, `stop_sequences` stop strings, `max_tokens` the completion limit.
The chat request they make is checked as any chat request is; a block or field the server
cannot honour is refused by name."""

from __future__ import annotations

import json
from typing import Any, ClassVar

from pydantic import Field, ValidationError, model_validator

from tidal.server.openai.chat import ChatRequest
from tidal.server.openai.protocol import APIError, StrictModel, refuse
from tidal.server.openai.renaming import renamed_error

# blocks a text-only server cannot read, and what they are
_UNREADABLE = {"image": "images", "document": "documents", "search_result": "search results",
               "container_upload": "container files"}


class MessagesChatRequest(ChatRequest):
    """The chat request a Messages body becomes: its limit is `max_tokens`."""

    def limit_field(self) -> str:
        return "max_tokens"


def _text(content: Any, where: str) -> str:
    """A tool result's or system prompt's content: a string, or text blocks joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(f"{where}: content must be a string or a list of blocks", param=where)
    texts = []
    for i, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind != "text" or not isinstance(block.get("text"), str):
            raise _unsupported(kind, f"{where}.{i}", "text blocks")
        texts.append(block["text"])
    return "\n".join(texts)


def _unsupported(kind: Any, where: str, takes: str) -> APIError:
    what = _UNREADABLE.get(kind)
    if what is not None:
        return APIError(f"{where}: {what} are not supported: this server runs a text-only "
                        f"model", param=where)
    return APIError(f"{where}.type: blocks of type {kind!r} are not supported here: this "
                    f"server takes {takes}", param=f"{where}.type")


def _user(content: Any, where: str) -> list[dict]:
    """A user turn: its tool results as tool messages (they answer the calls of the turn
    before), then its text as one user message."""
    if isinstance(content, str):
        return [{"role": "user", "content": content}]
    if not isinstance(content, list):
        raise APIError(f"{where}: content must be a string or a list of blocks", param=where)
    results, texts = [], []
    for i, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
        elif kind == "tool_result":
            if not isinstance(block.get("tool_use_id"), str):
                raise APIError(f"{where}.{i}.tool_use_id: a tool result names the tool_use "
                               f"it answers", param=f"{where}.{i}.tool_use_id")
            text = _text(block.get("content", ""), f"{where}.{i}.content")
            if block.get("is_error"):
                text = f"Error: {text}"
            results.append({"role": "tool", "tool_call_id": block["tool_use_id"],
                            "content": text})
        else:
            raise _unsupported(kind, f"{where}.{i}", "text and tool_result blocks")
    return results + ([{"role": "user", "content": "\n".join(texts)}] if texts else [])


def _assistant(content: Any, where: str) -> dict:
    """An assistant turn: its text, and its tool_use blocks as tool calls."""
    if isinstance(content, str):
        return {"role": "assistant", "content": content}
    if not isinstance(content, list):
        raise APIError(f"{where}: content must be a string or a list of blocks", param=where)
    texts, calls = [], []
    for i, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
        elif kind == "tool_use":
            if not (isinstance(block.get("id"), str) and isinstance(block.get("name"), str)
                    and isinstance(block.get("input", {}), dict)):
                raise APIError(f"{where}.{i}: a tool_use block has an id, a name and an "
                               f"object input", param=f"{where}.{i}")
            calls.append({"id": block["id"], "type": "function", "function": {
                "name": block["name"], "arguments": json.dumps(block.get("input", {}))}})
        elif kind not in ("thinking", "redacted_thinking"):
            raise _unsupported(kind, f"{where}.{i}", "text, tool_use and thinking blocks")
    message: dict = {"role": "assistant", "content": "\n".join(texts) or (None if calls else "")}
    if calls:
        message["tool_calls"] = calls
    return message


class MessagesRequest(StrictModel):
    """A /v1/messages body (docs/serving.md lists what is honoured, harmless and refused)."""

    _refused: ClassVar = {
        "container": ((), "this server runs no code containers"),
        "mcp_servers": ((), "this server connects to no MCP servers"),
        "context_management": ((), "this server edits no context"),
    }

    model: str | None = None
    messages: list[dict[str, Any]] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)  # required by /v1/messages (not count_tokens)
    system: str | list[dict[str, Any]] | None = None
    stop_sequences: list[str] | None = None
    temperature: float = Field(1.0, ge=0, le=1)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0)
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None
    stream: bool = False
    kv_transfer_params: dict | None = None  # P/D: {"prefill_address": ...}, set by the router
    # Harmless: they concern Anthropic's accounts, caching, regions and capacity, not the
    # output (docs/serving.md).
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None
    cache_control: dict[str, Any] | None = None
    diagnostics: dict[str, Any] | None = None
    inference_geo: str | None = None
    speed: str | None = None
    user_profile_id: str | None = None
    workspace_id: str | None = None

    @model_validator(mode="after")
    def _checks(self) -> "MessagesRequest":
        for i, m in enumerate(self.messages):
            if m.get("role") not in ("user", "assistant"):
                raise refuse(f"messages.{i}.role", f"a message's role must be user or "
                                                   f"assistant, got {m.get('role')!r} (the "
                                                   f"system prompt is the system field)")
        for i, tool in enumerate(self.tools or []):
            if tool.get("type", "custom") != "custom":
                raise refuse(f"tools.{i}.type", f"tools of type {tool.get('type')!r} are not "
                                                "supported: this server runs client tools "
                                                "(name, description, input_schema)")
            if not isinstance(tool.get("name"), str):
                raise refuse(f"tools.{i}.name", "a tool has a name")
        kind = (self.thinking or {}).get("type")
        if self.thinking is not None and kind not in THINKING:
            raise refuse("thinking.type", f"thinking.type must be one of {', '.join(THINKING)}"
                                          f", got {kind!r}")
        fmt = (self.output_config or {}).get("format")
        if set(self.output_config or {}) - {"format", "effort"}:
            raise refuse("output_config", "output_config takes format and effort")
        if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "json_schema"
                                    and isinstance(fmt.get("schema"), dict)):
            raise refuse("output_config.format", "output_config.format must be "
                                                 "{type: json_schema, schema: {...}}")
        return self

    def shows_thinking(self) -> bool:
        """Whether the answer carries the model's reasoning as thinking blocks (where the
        server reads it: --reasoning-parser)."""
        t = self.thinking or {}
        return t.get("type") != "disabled" and t.get("display") != "omitted"

    def chat_request(self, stream: bool | None = None) -> MessagesChatRequest:
        """The chat request this body runs as."""
        messages = [{"role": "system", "content": _text(self.system, "system")}] \
            if self.system else []
        for i, m in enumerate(self.messages):
            where = f"messages.{i}.content"
            if m["role"] == "user":
                messages += _user(m.get("content"), where)
            else:
                messages.append(_assistant(m.get("content"), where))
        chat: dict[str, Any] = {
            "model": self.model, "messages": messages, "max_completion_tokens": self.max_tokens,
            **self.sampling_given(), "stop": self.stop_sequences,
            "stream": self.stream if stream is None else stream}
        if self.kv_transfer_params is not None:
            chat["kv_transfer_params"] = self.kv_transfer_params
        if self.messages[-1]["role"] == "assistant":  # Anthropic's prefill: go on from it
            chat.update(add_generation_prompt=False, continue_final_message=True)
        if self.tools:
            chat["tools"] = [{"type": "function", "function": {
                "name": t["name"], "description": t.get("description"),
                "parameters": t.get("input_schema") or {"type": "object"}}}
                for t in self.tools]
        chat.update(self._tool_choice())
        if (self.thinking or {}).get("type") == "disabled":  # templates that can, skip it
            chat["chat_template_kwargs"] = {"enable_thinking": False}
        if not self.shows_thinking():
            chat["include_reasoning"] = False
        fmt = (self.output_config or {}).get("format")
        if fmt is not None:
            chat["response_format"] = {"type": "json_schema", "json_schema": {
                "name": "output", "schema": fmt["schema"]}}
        try:
            return MessagesChatRequest.model_validate(chat)
        except ValidationError as exc:
            raise renamed_error(exc, _RENAMED) from None

    def _tool_choice(self) -> dict:
        choice = self.tool_choice
        if choice is None:
            return {}
        kind = choice.get("type")
        out: dict[str, Any] = {"parallel_tool_calls": not choice.get(
            "disable_parallel_tool_use", False)}
        if kind in ("auto", "none"):
            out["tool_choice"] = kind
        elif kind == "any":
            out["tool_choice"] = "required"
        elif kind == "tool" and isinstance(choice.get("name"), str):
            out["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
        else:
            raise APIError(f"tool_choice.type must be auto, any, tool (with a name) or none, "
                           f"got {kind!r}", param="tool_choice.type")
        return out


THINKING = ("enabled", "adaptive", "between_tools", "disabled")  # thinking.type values
_RENAMED = {"max_completion_tokens": "max_tokens", "stop": "stop_sequences",
            "response_format": "output_config.format"}
