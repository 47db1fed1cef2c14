"""Request logging (vLLM's --enable-log-requests, --enable-log-outputs, --max-log-len): a
line per request as the cores take it (its id, prompt, token ids, the sampling parameters
it changed from their defaults, its adapter), and with outputs a line per sequence as it
ends (its text, token ids, finish reason). On the `tidal.requests` logger, so that it can
be routed apart from the server's own lines."""

from __future__ import annotations

import logging
from dataclasses import fields

from tidal.core import SamplingParams
from tidal.engine.outputs import StepUpdate

log = logging.getLogger("tidal.requests")
_DEFAULTS = SamplingParams()


def changed(params: SamplingParams) -> dict:
    """The parameters a request set apart from SamplingParams' defaults."""
    out = {}
    for f in fields(params):
        value = getattr(params, f.name)
        if value != getattr(_DEFAULTS, f.name) and f.name not in ("trace", "lora"):
            out[f.name] = value
    return out


class RequestLog:
    """Logs requests as they are sent and, with `outputs`, each sequence as it ends; text
    and token ids cut to `max_len` characters and ids (None: whole)."""

    def __init__(self, tokenizer, outputs: bool, max_len: int | None) -> None:
        self.tokenizer, self.outputs, self.max_len = tokenizer, outputs, max_len
        # a sequence's output so far: its text pieces and token ids
        self._outputs: dict[str, tuple[list[str], list[int]]] = {}

    def _cut(self, value):
        return value if self.max_len is None else value[:self.max_len]

    def received(self, rid: str, prompt: list[int], params: SamplingParams) -> None:
        text = self.tokenizer.decode(self._cut(prompt), skip_special_tokens=False)
        log.info("Received request %s: prompt: %r, prompt_token_ids: %s, params: %s, "
                 "lora: %s", rid, self._cut(text), self._cut(prompt), changed(params),
                 params.lora)

    def update(self, u: StepUpdate) -> None:
        """Note a sequence's new output; log it whole once it ends."""
        if not self.outputs:
            return
        texts, ids = self._outputs.setdefault(u.request_id, ([], []))
        texts.append(u.new_text)
        ids.extend(u.new_token_ids)
        if u.finished:
            del self._outputs[u.request_id]
            text = "".join(texts)
            log.info("Generated response %s: output: %r, output_token_ids: %s, "
                     "finish_reason: %s", u.request_id, self._cut(text), self._cut(ids),
                     u.finish_reason)

    def forget(self, rid: str) -> None:
        """A request that ended without finishing (aborted): drop what was kept of it."""
        for key in [k for k in self._outputs if k == rid or k.startswith(f"{rid}-")]:
            del self._outputs[key]
