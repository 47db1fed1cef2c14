"""SGLang's native answer to /generate: per sequence `text`, `output_ids` and `meta_info`
(its id, finish_reason as {"type": "stop", "matched": ...} or {"type": "length",
"length": ...}, token counts, the prefix cache's share, e2e_latency, logprobs as
[logprob, token id, text or null]). A batch (or n > 1) answers a list; a stream sends each
sequence's text and ids so far, then `data: [DONE]`, as SGLang does by default."""

from __future__ import annotations

import time
from typing import AsyncIterator

from tidal.core import TokenLogprob
from tidal.server.openai import schemas as s
from tidal.server.openai.generation_bodies import Choice, CompletionResponse, Updates
from tidal.server.openai.protocol import APIError


class GenerateBody(CompletionResponse):
    """POST /generate: its sequences in SGLang's shape, whole or streamed. `rids` names
    each prompt's answer (None: the server's ids); `start` is logprob_start_len (None: no
    prompt logprobs); `batch` whether the prompts came as a list."""

    def __init__(self, *args, rids: list[str] | None = None, batch: bool = False,
                 start: int | None = None, top: int = 0, text_in_logprobs: bool = False,
                 **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # the server's: the engine's request ids (`request_id` is the first prompt's)
        root = self.id.removeprefix("cmpl-").rsplit("-", 1)[0]
        base = rids or [f"{root}-{p}" for p in range(len(self.prompts))]
        self.ids = [base[i // self.n] if self.n == 1 else f"{base[i // self.n]}-{i % self.n}"
                    for i in range(len(self.choices))]
        self.listed = batch or self.n > 1  # SGLang answers a list for either
        self.start, self.top, self.text_in_logprobs = start, top, text_in_logprobs
        self.t0 = time.perf_counter()
        self.latency: list[float | None] = [None] * len(self.choices)

    def final(self, choices: list[Choice]):
        outs = [self.output(i, ch) for i, ch in enumerate(choices)]
        return outs if self.listed else outs[0]

    def output(self, i: int, ch: Choice) -> dict:
        """Sequence i's text, ids and meta_info so far."""
        p = i // self.n
        if ch.finish_reason is not None and self.latency[i] is None:
            self.latency[i] = time.perf_counter() - self.t0
        meta = {"id": self.ids[i], "finish_reason": self._finish(ch),
                "prompt_tokens": len(self.prompts[p]), "completion_tokens": len(ch.tokens),
                "cached_tokens": self.cached[p]}
        if self.latency[i] is not None:
            meta["e2e_latency"] = self.latency[i]
        if self.want_logprobs:
            meta["output_token_logprobs"] = [self._entry(e.logprob, t) for t, e in ch.logprobs]
            if self.top:
                meta["output_top_logprobs"] = [self._tops(e) for _, e in ch.logprobs]
        if self.start is not None:
            given = self.prompt_entries[p] or [None] * len(self.prompts[p])
            pairs = list(zip(self.prompts[p], given))[self.start:]
            meta["input_token_logprobs"] = [self._entry(e and e.logprob, t) for t, e in pairs]
            if self.top:
                meta["input_top_logprobs"] = [e and self._tops(e) for _, e in pairs]
        out = {"text": ch.text, "output_ids": ch.tokens, "meta_info": meta}
        if self.listed:
            out["index"] = i
        return out

    async def events(self, updates: Updates, include_usage: bool) -> AsyncIterator[str]:
        """Each update as its sequence's output so far (SGLang's default, non-incremental
        stream), an error as an error body, then [DONE]."""
        try:
            async for i, u in self._prompt_entries_first(updates):
                if u.finish_reason == "error":
                    raise APIError(u.finish_message or "generation failed", 500,
                                   "internal_error")
                self.choices[i].take(u)
                yield s.sse(self.output(i, self.choices[i]))
        except APIError as exc:
            yield s.sse(exc.body())
        finally:
            await updates.aclose()  # (the server then ends the requests: Submission.end)
        yield "data: [DONE]\n\n"

    @staticmethod
    def _finish(ch: Choice) -> dict | None:
        if ch.finish_reason is None:
            return None
        if ch.finish_reason == "length":
            return {"type": "length", "length": len(ch.tokens)}
        if ch.finish_reason == "stop":  # a stop string, else the token that ended it
            matched = ch.stop_string if ch.stop_string is not None else (
                ch.tokens[-1] if ch.tokens else None)
            return {"type": "stop", "matched": matched}
        return {"type": ch.finish_reason, "message": ch.message}

    def _entry(self, logprob: float | None, t: int) -> list:
        return [logprob, t, self.token_text(t) if self.text_in_logprobs else None]

    def _tops(self, e: TokenLogprob) -> list[list]:
        return [self._entry(alp, a) for a, alp in e.top]
