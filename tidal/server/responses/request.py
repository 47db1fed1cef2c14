"""Responses API request bodies (`POST /v1/responses`), served through the chat path: the
instructions, a stored predecessor's conversation and the input items become chat messages,
function tools chat tools, `text.format` a response_format, `max_output_tokens` the
completion limit. The chat request they make is checked as any chat request is; its errors
name the Responses field."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field, ValidationError, model_validator

from tidal.server.openai.chat import ChatRequest
from tidal.server.openai.protocol import APIError, StrictModel, refuse
from tidal.server.openai.refusals import RESPONSES_REFUSED

LOGPROBS_INCLUDE = "message.output_text.logprobs"  # the one `include` value tidal fills
# where a chat field's error points in a Responses body
_RENAMED = {"messages": "input", "max_completion_tokens": "max_output_tokens",
            "max_tokens": "max_output_tokens", "response_format": "text.format"}


class ResponsesChatRequest(ChatRequest):
    """The chat request a Responses body becomes: its 400s name the Responses fields."""

    prompt_field: ClassVar[str] = "input"

    def limit_field(self) -> str:
        return "max_output_tokens"

    def prompt_ids(self, tokenizer) -> list[list[int]]:
        try:
            return super().prompt_ids(tokenizer)
        except APIError as exc:  # the conversation is the input's
            if exc.param == "messages":
                exc.param, exc.message = "input", exc.message.replace("messages", "input")
            raise

    def output_constraint(self) -> tuple[str, tuple[str, str]] | None:
        constraint = super().output_constraint()
        if constraint is not None and constraint[0] == "response_format":
            return "text.format", constraint[1]
        return constraint


def _text(content: Any, where: str) -> str:
    """A message's content: a string, or input_text/output_text parts joined by newlines."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(f"{where}: content must be a string or a list of parts", param=where)
    texts = []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text") or not isinstance(part.get("text"), str):
            raise APIError(f"{where}.{i}: content parts of type {kind!r} are not supported: "
                           "this server takes input_text and output_text parts",
                           param=f"{where}.{i}")
        texts.append(part["text"])
    return "\n".join(texts)


def input_messages(items: str | list[dict]) -> list[dict]:
    """The input as chat messages: a string is one user message; messages keep their role,
    function calls become an assistant's tool calls (consecutive ones one message) and their
    outputs tool messages; reasoning items are left out (the chat template shows no earlier
    reasoning)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: list[dict] = []
    for i, item in enumerate(items):
        where = f"input.{i}"
        if not isinstance(item, dict):
            raise APIError(f"{where}: an input item must be an object", param=where)
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise APIError(f"{where}.role: a message's role must be user, system, "
                               f"developer or assistant, got {role!r}", param=f"{where}.role")
            out.append({"role": role, "content": _text(item.get("content"),
                                                       f"{where}.content")})
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments")}}
            if out and out[-1]["role"] == "assistant" and out[-1].get("tool_calls") \
                    and not out[-1]["content"]:
                out[-1]["tool_calls"].append(call)  # parallel calls: one assistant turn
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            out.append({"role": "tool", "tool_call_id": item.get("call_id"),
                        "content": output if isinstance(output, str)
                        else _text(output, f"{where}.output")})
        elif kind != "reasoning":
            raise APIError(f"{where}.type: input items of type {kind!r} are not supported: "
                           "this server takes message, function_call, function_call_output "
                           "and reasoning items", param=f"{where}.type")
    return out


class ResponsesRequest(StrictModel):
    """A /v1/responses body (docs/serving.md lists what is honoured, harmless and refused)."""

    _refused: ClassVar = RESPONSES_REFUSED

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    previous_response_id: str | None = None
    max_output_tokens: int | None = None
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    top_logprobs: int | None = Field(None, ge=0)
    include: list[str] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    stream: bool = False
    store: bool = True
    background: bool = False  # answered now as queued; the store holds it as it goes
    # Harmless (docs/serving.md): they concern OpenAI's accounts and caching, not the output.
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    prompt_cache_options: dict | None = None
    max_tool_calls: int | None = Field(None, ge=1)  # caps built-in tools' calls: tidal has none
    # auto: a conversation over the context drops its oldest items until it fits
    truncation: Literal["auto", "disabled"] | None = None
    stream_options: dict[str, bool] | None = None
    kv_transfer_params: dict | None = None  # P/D: {"prefill_address": ...}, set by the router

    @model_validator(mode="after")
    def _checks(self) -> "ResponsesRequest":
        if isinstance(self.input, list) and not self.input:
            raise refuse("input", "input must not be empty")
        for key, value in (self.reasoning or {}).items():
            if key not in ("effort", "summary", "generate_summary") or value is not None:
                raise refuse(f"reasoning.{key}", "reasoning controls are not supported: "
                                                 "this server has none (accepted: null)")
        for i, tool in enumerate(self.tools or []):
            if tool.get("type") != "function":
                raise refuse(f"tools.{i}.type", f"tools of type {tool.get('type')!r} are not "
                                                "supported: this server runs function tools")
        for value in self.include or []:
            if value != LOGPROBS_INCLUDE:
                raise refuse("include", f"include {value!r} is not supported (accepted: "
                                        f"{LOGPROBS_INCLUDE!r})")
        text = self.text or {}
        if set(text) - {"format", "verbosity"} or text.get("verbosity") not in (None, "medium"):
            raise refuse("text", "text takes format (and verbosity null or 'medium': this "
                                 "server has no verbosity control)")
        fmt = text.get("format")
        if fmt is not None and not (isinstance(fmt, dict) and isinstance(fmt.get("type"), str)):
            raise refuse("text.format", "text.format must be an object with a type")
        if self.background and not self.store:
            raise refuse("background", "background needs store: true (the response is "
                                       "polled from the store)")
        if self.background and self.stream:
            raise refuse("background", "a background response is not streamed here: poll "
                                       "GET /v1/responses/{id}")
        if set(self.stream_options or {}) - {"include_obfuscation"}:
            raise refuse("stream_options", "stream_options takes include_obfuscation only")
        return self

    def text_format(self) -> dict:
        return (self.text or {}).get("format") or {"type": "text"}

    def chat_request(self, history: list[dict], drop: int = 0,
                     ) -> tuple[ResponsesChatRequest, list[dict]]:
        """(the chat request, the conversation it continues: `history` and the input, the
        instructions left out, as a stored response keeps it for its successors). The
        request leaves out the conversation's first `drop` messages (truncation)."""
        conversation = history + input_messages(self.input)
        system = [{"role": "system", "content": self.instructions}] if self.instructions else []
        chat: dict[str, Any] = {
            "model": self.model, "messages": system + conversation[drop:],
            "max_completion_tokens": self.max_output_tokens, **self.sampling_given(),
            "stream": self.stream,
            "parallel_tool_calls": self.parallel_tool_calls,
            "response_format": self._response_format()}
        if self.kv_transfer_params is not None:
            chat["kv_transfer_params"] = self.kv_transfer_params
        if LOGPROBS_INCLUDE in (self.include or []) or self.top_logprobs:
            chat.update(logprobs=True, top_logprobs=self.top_logprobs)
        if self.tools:
            chat["tools"] = [{"type": "function", "function": {
                k: v for k, v in t.items() if k != "type"}} for t in self.tools]
        if self.tool_choice is not None:
            chat["tool_choice"] = self._tool_choice()
        try:
            return ResponsesChatRequest.model_validate(chat), conversation
        except ValidationError as exc:
            raise _renamed(exc) from None

    def fitted(self, history: list[dict], tokenizer, max_model_len: int,
               ) -> tuple[ResponsesChatRequest, list[dict], list[list[int]]]:
        """chat_request's pair and the prompt; with truncation auto, the request leaves out
        the fewest oldest messages that fit the context with room for max_output_tokens (a
        token without it), never the last message nor a tool result without its call.
        Where even that does not fit, the whole (the 400 follows)."""
        chat, conversation = self.chat_request(history)
        prompts = chat.prompt_ids(tokenizer)
        room = max_model_len - (self.max_output_tokens or 1)
        if self.truncation != "auto" or len(prompts[0]) <= room:
            return chat, conversation, prompts
        starts = [d for d in range(1, len(conversation)) if conversation[d]["role"] != "tool"]
        best = None
        lo, hi = 0, len(starts) - 1
        while lo <= hi:  # fewer messages, fewer tokens: the first start that fits
            mid = (lo + hi) // 2
            cut, _ = self.chat_request(history, starts[mid])
            ids = cut.prompt_ids(tokenizer)
            if len(ids[0]) <= room:
                best, hi = (cut, conversation, ids), mid - 1
            else:
                lo = mid + 1
        return best or (chat, conversation, prompts)

    def _response_format(self) -> dict | None:
        fmt = self.text_format()
        kind = fmt.get("type")
        if kind == "json_schema":
            spec = {k: v for k, v in fmt.items() if k != "type"}
            return {"type": "json_schema", "json_schema": spec}
        if kind in ("text", "json_object"):
            return None if kind == "text" else {"type": "json_object"}
        raise APIError(f"text.format.type must be text, json_object or json_schema, got "
                       f"{kind!r}", param="text.format.type")

    def _tool_choice(self) -> str | dict:
        choice = self.tool_choice
        if isinstance(choice, str) or choice is None:
            return choice
        if choice.get("type") == "function" and isinstance(choice.get("name"), str):
            return {"type": "function", "function": {"name": choice["name"]}}
        raise APIError(f"tool_choice of type {choice.get('type')!r} is not supported: this "
                       "server takes none, auto, required or {type: function, name}",
                       param="tool_choice")


def _renamed(exc: ValidationError) -> APIError:
    """The chat request's first validation error, naming the Responses field."""
    first = exc.errors()[0]
    loc = [str(p) for p in first["loc"] if isinstance(p, int) or p[:1].islower()]
    if first["type"] == "refused":
        loc.append(first["ctx"]["param"])
    head = _RENAMED.get(loc[0], loc[0]) if loc else None
    if head == "input":
        loc = loc[:1]  # a message's index is not the input item's
    elif head == "tools" and len(loc) > 2 and loc[2] == "function":
        del loc[2]  # chat nests a tool under "function"; Responses does not
    where = ".".join([head, *loc[1:]]) if head else None
    message = first["msg"] if first["type"] == "refused" else \
        f"{where or 'input'}: {first['msg']}"
    for old, new in _RENAMED.items():
        message = message.replace(old, new)
    return APIError(message, param=where)
