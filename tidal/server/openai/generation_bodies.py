"""OpenAI response bodies. One class per endpoint (ChatResponse, CompletionResponse) says how
its choices, deltas and logprobs look; their base turns a request's token updates into the
final body (stream=false) or the SSE chunks (stream=true), as the typed structs of
`schemas.py`."""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from functools import partial
from typing import AsyncGenerator, AsyncIterator

from fastapi.responses import Response

from tidal.core import PromptLogprob, TokenLogprob
from tidal.engine.outputs import StepUpdate
from tidal.server.openai import schemas as s
from tidal.server.openai.chat_output import ChatOutputOptions, ChoiceOutput
from tidal.server.openai.protocol import APIError
from tidal.server.openai.reasoning import reasoning_tokens

# (choice index, update) until every choice finished; raises APIError when the request fails
Updates = AsyncGenerator[tuple[int, StepUpdate], None]
# a token and its logprobs (None: an echoed prompt's first token, which nothing predicts)
Entry = tuple[int, TokenLogprob | None]


def json_response(obj) -> Response:
    return Response(s.encode(obj), media_type="application/json")


@dataclass
class Choice:
    """One answer (of n, or of one prompt) as its updates accumulate."""

    text: str = ""
    tokens: list[int] = field(default_factory=list)
    logprobs: list[Entry] = field(default_factory=list)
    finish_reason: str | None = None
    message: str | None = None
    stop_string: str | None = None  # the stop string that ended it, if one did

    def take(self, u: StepUpdate) -> None:
        """Add an update's text, tokens and logprobs, and its end."""
        self.text += u.new_text
        self.tokens.extend(u.new_token_ids)
        self.logprobs.extend(token_entries(u))
        if u.finished:
            self.finish_reason, self.message = u.finish_reason, u.finish_message
            self.stop_string = u.stop_string


def token_entries(u: StepUpdate) -> list[Entry]:
    """An update's new tokens, each with its logprobs where they were asked for."""
    return list(zip(u.new_token_ids, u.logprobs or []))


class GenerationResponse:
    """What chat and completions share: the envelope (id, object, created, model), the
    choices as they accumulate, usage, and the loops over the updates. Subclasses fill in
    the endpoint's own shapes."""

    id_prefix = ""
    chunk_object = ""

    def __init__(self, tokenizer, model_name: str, request_id: str, prompts: list[list[int]],
                 num_choices: int, logprobs: bool, token_bytes=None,
                 prompt_logprobs: bool = False, token_ids: bool = False,
                 tokens_as_ids: bool = False) -> None:
        self.tokenizer, self.model_name, self.prompts = tokenizer, model_name, prompts
        self.id, self.created = f"{self.id_prefix}-{request_id}", int(time.time())
        self.choices = [Choice() for _ in range(num_choices)]
        self.n = num_choices // len(prompts)  # choice i answers prompt i // n
        self.want_logprobs = logprobs
        # a token's own bytes (a partial UTF-8 character stays partial); else its text's
        self._token_bytes = token_bytes
        self.want_prompt_logprobs = prompt_logprobs  # vLLM's field, in the response
        # each prompt's logprobs, as the engine sent them
        self.prompt_entries: list[list[PromptLogprob | None] | None] = [None] * len(prompts)
        self.cached = [0] * len(prompts)  # each prompt's tokens the prefix cache held
        self.want_token_ids = token_ids  # vLLM's return_token_ids
        self.tokens_as_ids = tokens_as_ids  # vLLM's return_tokens_as_token_ids
        self.unsent = [[] for _ in self.choices]  # a stream's tokens not yet in a chunk
        # vLLM's stream_options.continuous_usage_stats: every chunk carries the usage so far
        self.continuous_usage = False

    # ------------------------------------------------------------------ per endpoint
    def logprobs(self, entries: list[Entry], offset: int):
        raise NotImplementedError

    def final(self, choices: list[Choice]):
        """The whole body (stream=false)."""
        raise NotImplementedError

    def chunk_choice(self, i: int, new_text: str, lp, finish_reason: str | None):
        """A streamed chunk's choice holding new text (None: nothing to send yet)."""
        raise NotImplementedError

    def opening(self) -> list:
        """Choices of a chunk sent before any token (none unless the endpoint wants one)."""
        return []

    def needs_prompt_entries(self) -> bool:
        """Whether a choice's first chunk waits for its prompt's logprobs."""
        return self.want_prompt_logprobs

    def keep(self, u: StepUpdate) -> StepUpdate:
        """An update as the response counts it (completions' echo of a prompt alone drops
        the token sampled after it)."""
        return u

    # ------------------------------------------------------------------ shared
    def vllm_prompt_logprobs(self, p: int) -> s.PromptLogprobs:
        """Prompt p's logprobs in vLLM's shape: per token, the token and its alternatives."""
        text, out = self.logprob_token, []
        for t, entry in zip(self.prompts[p], self.prompt_entries[p] or []):
            if entry is None:
                out.append(None)
                continue
            d = {str(t): s.RankedLogprob(entry.logprob, entry.rank, text(t))}
            for r, (a, alp) in enumerate(entry.top, 1):
                d.setdefault(str(a), s.RankedLogprob(alp, r, text(a)))
            out.append(d)
        return out

    async def _prompt_entries_first(self, updates: Updates) -> Updates:
        """The updates, each prompt's logprobs noted; with needs_prompt_entries, a choice's
        updates wait until its prompt's logprobs are here (they come with choice 0's first
        token, which a sibling's may precede)."""
        held: dict[int, list] = {}
        async for i, u in updates:
            p = i // self.n
            if u.prompt_logprobs is not None:
                self.prompt_entries[p] = u.prompt_logprobs
            if i % self.n == 0:  # its index 0 (siblings share that prompt's blocks)
                self.cached[p] = u.cached_tokens
            if self.needs_prompt_entries() and self.prompt_entries[p] is None:
                held.setdefault(p, []).append((i, u))
                continue
            for hi, hu in held.pop(p, []):
                yield hi, self.keep(hu)
            yield i, self.keep(u)
        for items in held.values():  # never came (the request failed): as they are
            for i, u in items:
                yield i, self.keep(u)

    def token_text(self, t: int) -> str:
        return self.tokenizer.decode([t], skip_special_tokens=False)

    def logprob_token(self, t: int) -> str:
        """A token as logprobs name it: its text, or `token_id:<id>` (vLLM's
        return_tokens_as_token_ids: no two tokens alike, none lost to decoding)."""
        return f"token_id:{t}" if self.tokens_as_ids else self.token_text(t)

    def token_bytes(self, t: int) -> list[int]:
        raw = self._token_bytes(t) if self._token_bytes else self.token_text(t).encode()
        return list(raw)

    def usage(self) -> s.Usage:
        p = sum(len(ids) for ids in self.prompts)  # once per prompt, whatever n is
        c = sum(len(ch.tokens) for ch in self.choices)
        return s.Usage(p, c, p + c, s.PromptTokensDetails(sum(self.cached)))

    def chunk(self, choices: list, **extra) -> str:
        return s.sse(s.Chunk(self.id, self.chunk_object, self.created, self.model_name,
                             s.FINGERPRINT, choices, **extra))

    async def body(self, updates: Updates) -> Response:
        """The whole response once every choice finished (stream=false)."""
        async for i, u in self._prompt_entries_first(updates):
            self.choices[i].take(u)
        for ch in self.choices:
            if ch.finish_reason == "error":
                raise APIError(ch.message or "generation failed", 500, "internal_error")
        return json_response(self.final(self.choices))

    async def events(self, updates: Updates, include_usage: bool) -> AsyncIterator[str]:
        """SSE chunks as tokens come, errors as error bodies, then [DONE] (stream=true)."""
        extra = {"usage": None} if include_usage else {}
        running = include_usage and self.continuous_usage
        try:
            opening = self.opening()
            if opening:
                first = {"prompt_token_ids": self.prompts[0]} if self.want_token_ids else {}
                if running:
                    extra["usage"] = GenerationResponse.usage(self)
                yield self.chunk(opening, **extra, **first)
            async for i, u in self._prompt_entries_first(updates):
                ch = self.choices[i]
                lp = self.logprobs(token_entries(u), len(ch.text)) if self.want_logprobs else None
                ch.text += u.new_text
                ch.tokens.extend(u.new_token_ids)
                if u.finish_reason == "error":
                    yield s.sse(APIError(u.finish_message or "generation failed", 500,
                                         "internal_error").body())
                    continue
                part = self.chunk_choice(i, u.new_text, lp,
                                         u.finish_reason if u.finished else None)
                if self.want_token_ids:
                    self.unsent[i] += u.new_token_ids
                    if part is not None:  # the tokens since the last chunk that went
                        part.token_ids, self.unsent[i] = self.unsent[i], []
                if part is not None:
                    if running:  # the counts so far (the last chunk's usage adds details)
                        extra["usage"] = GenerationResponse.usage(self)
                    yield self.chunk([part], **extra)
            if include_usage:
                yield self.chunk([], usage=self.usage())
        except APIError as exc:
            yield s.sse(exc.body())
        finally:
            await updates.aclose()  # (the server then ends the requests: Submission.end)
        yield "data: [DONE]\n\n"


class ChatResponse(GenerationResponse):
    """/v1/chat/completions: messages (reasoning, content and tool calls read by
    `chat_output.py`), role-then-content deltas, per-token logprob content."""

    id_prefix = "chatcmpl"
    chunk_object = "chat.completion.chunk"

    def __init__(self, *args, options: ChatOutputOptions | None = None, echo: str = "",
                 **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.options = options or ChatOutputOptions()
        self.outputs = [ChoiceOutput(self.options) for _ in self.choices]
        self.echo = echo  # vLLM's chat echo: the last message's text, before each answer

    def usage(self) -> s.Usage:
        """With a reasoning parser, the output tokens that carry reasoning are counted too
        (`completion_tokens_details.reasoning_tokens`, as OpenAI's)."""
        u = super().usage()
        if self.options.reasoning:
            decode = partial(self.tokenizer.decode, skip_special_tokens=False)
            u.completion_tokens_details = s.CompletionTokensDetails(sum(
                reasoning_tokens(ch.tokens, decode, self.options.prompt_opens_thinking,
                                 self.options.reasoning)
                for ch in self.choices))
        return u

    def logprobs(self, entries: list[Entry], offset: int) -> s.ChatLogprobs:
        text, raw = self.logprob_token, self.token_bytes
        return s.ChatLogprobs([
            s.ChatTokenLogprob(text(t), e.logprob, raw(t), [s.TopLogprob(text(a), alp, raw(a))
                                                        for a, alp in e.top])
            for t, e in entries])

    def final(self, choices: list[Choice]) -> s.ChatCompletion:
        out = []
        for i, (ch, reader) in enumerate(zip(choices, self.outputs)):
            reader.feed(ch.text, last=True)
            content: str | None = reader.content
            if self.options.tool_parser is not None:
                content = content.strip() or None  # the text around calls
            if self.echo:
                content = self.echo + (content or "")
            message = s.AssistantMessage(self.options.role, content, None, reader.calls,
                                         reader.reasoning or None)
            lp = self.logprobs(ch.logprobs, 0) if self.want_logprobs else None
            out.append(s.ChatChoice(i, message, lp, reader.finish_reason(ch.finish_reason)))
            if self.want_token_ids:
                out[-1].token_ids = ch.tokens
        body = s.ChatCompletion(self.id, self.created, self.model_name, out, self.usage())
        if self.want_prompt_logprobs:
            body.prompt_logprobs = self.vllm_prompt_logprobs(0)
        if self.want_token_ids:
            body.prompt_token_ids = self.prompts[0]
        return body

    def chunk_choice(self, i: int, new_text: str, lp, finish_reason: str | None):
        reader = self.outputs[i]
        piece = reader.feed(new_text, last=finish_reason is not None)
        if finish_reason is not None:
            finish_reason = reader.finish_reason(finish_reason)
        if not (piece.reasoning or piece.content or piece.calls or lp or finish_reason):
            return None
        delta = s.Delta(content=piece.content or None,
                        reasoning_content=piece.reasoning or None, tool_calls=piece.calls)
        return s.ChatChunkChoice(i, delta, lp, finish_reason)

    def opening(self) -> list:
        role = self.options.role
        return [s.ChatChunkChoice(i, s.Delta(role=role, content=self.echo), None, None)
                for i in range(len(self.choices))]


class CompletionResponse(GenerationResponse):
    """/v1/completions: text choices and the legacy logprobs shape with text offsets; with
    `echo`, each choice starts with its prompt (and the prompt's logprobs, the first token's
    null), and `max_tokens: 0` returns the prompt alone."""

    id_prefix = "cmpl"
    chunk_object = "text_completion"

    def __init__(self, *args, echo: bool = False, sent: list[str] | None = None,
                 prompt_only: bool = False, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.prompt_only = prompt_only
        self.echo: list[str] | None = None  # each prompt's text: as sent, or its ids decoded
        if echo:  # (the ids were checked against the vocabulary on submit)
            self.echo = sent or [self.tokenizer.decode(ids, skip_special_tokens=False)
                                 for ids in self.prompts]
        self._opened = [False] * len(self.choices)
        if self.echo is not None:  # the text offsets of the output count from the prompt's start
            for i, ch in enumerate(self.choices):
                ch.text = self.echo[i // self.n]

    def needs_prompt_entries(self) -> bool:
        return self.want_prompt_logprobs or (self.echo is not None and self.want_logprobs)

    def keep(self, u: StepUpdate) -> StepUpdate:
        if not self.prompt_only:
            return u
        reason = u.finish_reason  # a failure stays one; the sampled token's end does not count
        return replace(u, new_token_ids=[], new_text="", logprobs=None,
                       finish_reason="length" if reason in ("stop", "length") else reason)

    def logprobs(self, entries: list[Entry], offset: int) -> s.CompletionLogprobs:
        tokens, lps, tops, offsets = [], [], [], []
        for t, entry in entries:
            tokens.append(self.logprob_token(t))
            lps.append(entry.logprob if entry else None)
            tops.append({self.logprob_token(a): alp for a, alp in entry.top} if entry else None)
            offsets.append(offset)
            offset += len(self.token_text(t))  # where it lies in the text
        return s.CompletionLogprobs(tokens, lps, tops, offsets)

    def _echoed(self, i: int) -> list[Entry]:
        """Choice i's prompt as logprob entries (a PromptLogprob is a TokenLogprob)."""
        p = i // self.n
        entries = self.prompt_entries[p] or [None] * len(self.prompts[p])
        return list(zip(self.prompts[p], entries))

    def final(self, choices: list[Choice]) -> s.Completion:
        out = []
        for i, ch in enumerate(choices):
            lp = None
            if self.want_logprobs:
                echoed = self._echoed(i) if self.echo is not None else []
                lp = self.logprobs(echoed + ch.logprobs, 0)
            out.append(self._with_prompt(s.CompletionChoice(i, ch.text, lp, ch.finish_reason),
                                         i))
            if self.want_token_ids:
                out[-1].token_ids = ch.tokens
        return s.Completion(self.id, self.created, self.model_name, out, self.usage())

    def chunk_choice(self, i: int, new_text: str, lp, finish_reason: str | None):
        if not self._opened[i]:  # the first chunk of a choice carries its prompt
            self._opened[i] = True
            if self.echo is not None:
                new_text = self.echo[i // self.n] + new_text
                if self.want_logprobs:
                    head = self.logprobs(self._echoed(i), 0)
                    lp = _joined(head, lp)
            return self._with_prompt(s.CompletionChoice(i, new_text, lp, finish_reason), i)
        if not (new_text or finish_reason or lp):
            return None
        return s.CompletionChoice(i, new_text, lp, finish_reason)

    def _with_prompt(self, choice: s.CompletionChoice, i: int) -> s.CompletionChoice:
        if self.want_prompt_logprobs:
            choice.prompt_logprobs = self.vllm_prompt_logprobs(i // self.n)
        if self.want_token_ids:
            choice.prompt_token_ids = self.prompts[i // self.n]
        return choice


def _joined(a: s.CompletionLogprobs, b: s.CompletionLogprobs | None) -> s.CompletionLogprobs:
    if b is None:
        return a
    return s.CompletionLogprobs(a.tokens + b.tokens, a.token_logprobs + b.token_logprobs,
                                a.top_logprobs + b.top_logprobs, a.text_offset + b.text_offset)
