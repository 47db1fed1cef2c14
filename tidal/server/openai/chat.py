"""Chat request bodies: messages (text or text parts; tool calls and tool results), the
conversation through the model's chat template (with tools, documents and template
arguments), and /tokenize, which renders messages the same way."""

from __future__ import annotations

import json
from typing import Any, ClassVar, Literal

from jinja2 import TemplateError
from pydantic import Field, PrivateAttr, model_validator

from tidal.server.openai.protocol import (APIError, GenerationRequest, StrictModel, encode, refuse)
from tidal.server.openai.refusals import CHAT_REFUSED, VLLM_REFUSED
from tidal.server.openai.tools import (Tool, ToolChoice, template_conversation, tool_constraint,
                                       tool_dicts)

# Template variables a request's chat_template_kwargs may not set: the server sets them.
RESERVED_TEMPLATE_ARGS = ("messages", "tools", "documents", "add_generation_prompt",
                          "continue_final_message")


def _part_text(i: int, part: Any) -> str:
    """A content part's text; any other kind of part is refused."""
    where = f"content.{i}"
    if not isinstance(part, dict):
        raise refuse(where, "a content part must be an object with a 'type'")
    kind = part.get("type")
    if kind != "text":
        raise refuse(f"{where}.type", f"content parts of type {kind!r} are not supported: "
                                      "this server takes text parts only")
    for key in part:
        if key not in ("type", "text", "prompt_cache_breakpoint"):  # the last is a cache hint
            raise refuse(f"{where}.{key}", f"Unrecognized request argument supplied: {key}")
    if not isinstance(part.get("text"), str):
        raise refuse(f"{where}.text", "a text part needs a string 'text'")
    return part["text"]


class CalledFunction(StrictModel):
    name: str
    arguments: str  # a JSON object, as the model wrote it

    @model_validator(mode="after")
    def _object(self) -> "CalledFunction":
        try:
            ok = isinstance(json.loads(self.arguments), dict)
        except ValueError:
            ok = False
        if not ok:
            raise refuse("arguments", "a tool call's arguments must be a JSON object")
        return self


class AssistantToolCall(StrictModel):
    """A call an earlier assistant turn made."""

    id: str
    type: Literal["function"]
    function: CalledFunction


class ChatMessage(StrictModel):
    """One message of a conversation; content is text or a list of text parts, joined with
    newlines (as vLLM does) but kept for a template that reads parts (the content format).
    `name` goes to the chat template; assistant messages may hold `tool_calls`, and `tool`
    messages answer one by its `tool_call_id`."""

    _refused: ClassVar = {
        "function_call": ((), "use tool_calls"),
        "audio": ((), "tidal serves text-only models"),
        "refusal": ((), "tidal does not write refusals"),
    }

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | None = None
    name: str | None = None
    tool_calls: list[AssistantToolCall] | None = None
    tool_call_id: str | None = None

    _parts: list[str] | None = PrivateAttr(None)  # the text parts, as the request sent them

    @model_validator(mode="wrap")
    @classmethod
    def _content(cls, data: Any, handler) -> "ChatMessage":
        parts = None
        if isinstance(data, dict):
            if data.get("role") == "function":
                raise refuse("role", "'function' messages are not supported: they are "
                                     "OpenAI's older form of 'tool' messages")
            if isinstance(data.get("content"), list):
                parts = [_part_text(i, p) for i, p in enumerate(data["content"])]
                data = {**data, "content": "\n".join(parts)}
        message = handler(data)
        message._parts = parts
        return message

    @model_validator(mode="after")
    def _tool_fields(self) -> "ChatMessage":
        if self.tool_calls and self.role != "assistant":
            raise refuse("tool_calls", "only assistant messages hold tool_calls")
        if (self.role == "tool") != (self.tool_call_id is not None):
            raise refuse("tool_call_id", "a tool message, and only a tool message, needs the "
                                         "tool_call_id it answers")
        return self

    def template_dict(self) -> dict:
        """The message as the chat template sees it (developer messages as system ones)."""
        content = ([{"type": "text", "text": t} for t in self._parts] if self._parts is not None
                   else self.content or "")  # parts: a template may read them one by one
        out: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role,
                               "content": content}
        if self.name is not None:
            out["name"] = self.name
        if self.tool_calls:
            out["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


def check_render(add_generation_prompt: bool, continue_final_message: bool,
                 template_args: dict | None) -> None:
    """Refuse a render the template cannot give: the last message continued after a
    generation prompt, or template kwargs that set what has a field of its own."""
    if continue_final_message and add_generation_prompt:
        raise refuse("continue_final_message", "continue_final_message needs "
                                               "add_generation_prompt=false")
    taken = [k for k in (template_args or {}) if k in RESERVED_TEMPLATE_ARGS]
    if taken:
        raise refuse(f"chat_template_kwargs.{taken[0]}",
                     f"chat_template_kwargs may not set {taken[0]!r}: it has its own field")


def chat_prompt_text(messages: list[ChatMessage], tokenizer, add_generation_prompt: bool,
                     tools: list[dict] | None = None, documents: list[dict] | None = None,
                     continue_final_message: bool = False,
                     template_args: dict | None = None, chat_template: str | None = None,
                     ) -> str:
    """A conversation through the model's chat template (or the request's own,
    `chat_template`). A template that does not read `tools` gets them (and the calls and
    results) as text (tools.py)."""
    if not messages:
        raise APIError("messages must not be empty", param="messages")
    if all(not m.content and not m.tool_calls for m in messages):
        raise APIError("the messages hold no text", param="messages")
    dicts = [m.template_dict() for m in messages]
    extra: dict[str, Any] = dict(template_args or {})
    if chat_template is None:
        template = getattr(tokenizer, "chat_template", None)
    else:
        try:
            template = tokenizer.template(chat_template)
        except TemplateError as exc:
            raise APIError(f"chat_template does not compile: {exc}",
                           param="chat_template") from exc
        extra["chat_template"] = chat_template
    native = not hasattr(template, "mentions") or template.mentions("tools")
    dicts, tools = template_conversation(dicts, tools, native)
    for name, value in (("tools", tools), ("documents", documents),
                        ("continue_final_message", continue_final_message or None)):
        if value is not None:
            extra[name] = value
    try:
        return tokenizer.apply_chat_template(dicts, add_generation_prompt=add_generation_prompt,
                                             **extra)
    except (ValueError, TypeError, TemplateError) as exc:  # the template refused them
        raise APIError(f"the chat template refused the messages: {exc}",
                       param="messages") from exc


class Prediction(StrictModel):
    """OpenAI's predicted output: text the answer is expected to repeat (a string or text
    parts, joined)."""

    type: Literal["content"]
    content: str

    @model_validator(mode="before")
    @classmethod
    def _parts(cls, data: Any) -> Any:
        content = data.get("content") if isinstance(data, dict) else None
        if isinstance(content, list):
            data = {**data, "content": "".join(_part_text(i, p) for i, p in enumerate(content))}
        return data


class ChatRequest(GenerationRequest):
    """A /v1/chat/completions body."""

    _refused: ClassVar = {**VLLM_REFUSED, **CHAT_REFUSED}
    logprobs_field: ClassVar[str] = "top_logprobs"
    prompt_field: ClassVar[str] = "messages"

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0)
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None  # "auto" when tools are given, as OpenAI's
    parallel_tool_calls: bool = True
    add_generation_prompt: bool = True  # vLLM: end the prompt where the assistant answers
    continue_final_message: bool = False  # vLLM: the prompt ends inside the last message
    add_special_tokens: bool = False  # vLLM: the chat template writes them already
    documents: list[dict[str, Any]] | None = None  # vLLM: for templates that cite documents
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM: e.g. {"enable_thinking": false}
    # vLLM: this request's own template (a server started with --trust-request-chat-template)
    chat_template: str | None = Field(None, min_length=1)
    include_reasoning: bool = True  # vLLM: with --reasoning-parser, reasoning_content or none
    prediction: Prediction | None = None  # OpenAI's: guesses for a speculating server
    echo: bool = False  # vLLM: each answer starts with the last message it continues
    # Harmless (docs/serving.md): they concern OpenAI's storage and caching, not the output.
    metadata: dict[str, str] | None = None
    store: bool | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    prompt_cache_options: dict | None = None
    safety_identifier: str | None = None
    _prompt_text: str = PrivateAttr("")
    _prediction: list[int] | None = PrivateAttr(None)

    @model_validator(mode="after")
    def _chat_checks(self) -> "ChatRequest":
        if self.tool_choice not in (None, "none", "auto") and not self.tools:
            raise refuse("tool_choice", "tool_choice needs tools")
        forced = tool_constraint(self.tools or [], self.tool_choice or "auto",
                                 self.parallel_tool_calls)
        if forced is not None:
            if self._constraint is not None:
                raise refuse("tool_choice", f"tool_choice {self.tool_mode()!r} and "
                                            f"{self._constraint[0]} both constrain the "
                                            "output: send one")
            self._constraint = ("tool_choice", forced)
        if self.prompt_logprobs is not None and self.stream:
            raise refuse("prompt_logprobs", "prompt_logprobs with stream=true is only "
                                            "supported on /v1/completions")
        check_render(self.add_generation_prompt, self.continue_final_message,
                     self.chat_template_kwargs)
        return self

    def tool_mode(self) -> str:
        """none, auto, required, or the forced function's name."""
        if not self.tools:
            return "none"
        choice = self.tool_choice or "auto"
        return choice if isinstance(choice, str) else choice.function.name

    def prompt_ids(self, tokenizer) -> list[list[int]]:
        """The conversation through the chat template, as the one prompt's token ids."""
        # tool_choice none still shows the tools (vLLM's default); their calls go unparsed
        self._prompt_text = chat_prompt_text(
            self.messages, tokenizer, self.add_generation_prompt, tool_dicts(self.tools),
            self.documents, self.continue_final_message, self.chat_template_kwargs,
            self.chat_template)
        if self.prediction is not None and self.prediction.content:
            self._prediction = encode(tokenizer, self.prediction.content, False,
                                      "prediction.content")
        return [encode(tokenizer, self._prompt_text, self.add_special_tokens, "messages")]

    def prediction_ids(self) -> list[int] | None:
        """The predicted output's tokens (after prompt_ids), if one was sent."""
        return self._prediction

    def echoed(self) -> str:
        """With `echo`, the text each answer starts with: the last message's, when the
        answer continues it (it is the assistant's, or no generation prompt follows it)."""
        last = self.messages[-1]
        if not self.echo or (self.add_generation_prompt and last.role != "assistant"):
            return ""
        return last.content or ""

    def prompt_text(self) -> str:
        """The prompt as the template wrote it (after prompt_ids)."""
        return self._prompt_text

    def num_logprobs(self) -> int | None:
        """Alternatives per token to report (0: the chosen token's only), None for none."""
        if self.top_logprobs and not self.logprobs:
            raise APIError("top_logprobs needs logprobs=true", param="top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None

    def output_limit(self) -> int | None:
        """max_completion_tokens, or the older max_tokens."""
        return (self.max_completion_tokens if self.max_completion_tokens is not None
                else self.max_tokens)

    def limit_field(self) -> str:
        return "max_tokens" if self.max_completion_tokens is None else "max_completion_tokens"


class TokenizeRequest(StrictModel):
    """POST /tokenize, either of vLLM's shapes: {prompt} or {messages} (with tools);
    `return_token_strs` adds each token as the vocabulary spells it."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    tools: list[Tool] | None = None  # messages only
    add_generation_prompt: bool = True  # messages only
    continue_final_message: bool = False  # messages only, as ChatRequest's
    chat_template_kwargs: dict[str, Any] | None = None  # messages only
    return_token_strs: bool = False
    add_special_tokens: bool | None = None  # vLLM's default: true for a prompt, false for messages
    chat_template: str | None = Field(None, min_length=1)  # messages only, as ChatRequest's

    @model_validator(mode="after")
    def _one_input(self) -> "TokenizeRequest":
        if (self.prompt is None) == (self.messages is None):
            raise refuse("prompt", "send either prompt or messages")
        check_render(self.add_generation_prompt, self.continue_final_message,
                     self.chat_template_kwargs)
        return self

    def token_ids(self, tokenizer) -> list[int]:
        special = self.add_special_tokens
        if self.prompt is not None:
            return encode(tokenizer, self.prompt, special is not False, "prompt")
        text = chat_prompt_text(self.messages, tokenizer, self.add_generation_prompt,
                                tool_dicts(self.tools), None, self.continue_final_message,
                                self.chat_template_kwargs, self.chat_template)
        return encode(tokenizer, text, bool(special), "messages")
