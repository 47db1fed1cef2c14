"""Incremental detokenization with stop strings.

Decoding a growing id list token by token breaks multi-byte characters and merged spaces,
so each step decodes a small window (from `prefix` to the end) and keeps only the text past
what the window's first part already produced; a trailing U+FFFD means "wait for more".
"""

from __future__ import annotations


class IncrementalDetokenizer:
    """Text of one request's output, grown a token at a time, cut at the first stop string."""

    def __init__(self, tokenizer, stop: list[str], skip_special_tokens: bool = True,
                 include_stop: bool = False) -> None:
        """`include_stop`: the text keeps the stop string it was cut at."""
        self.tokenizer = tokenizer
        self.stop = stop
        self.skip = skip_special_tokens
        self.include_stop = include_stop
        self.ids: list[int] = []
        self.text = ""
        self.prefix = 0  # window start in ids
        self.read = 0  # ids already turned into text
        self.emitted = 0  # chars of text already returned
        self.stopped = False
        self.stop_string: str | None = None  # the stop string the text was cut at
        self._hold = max((len(s) for s in stop), default=1) - 1  # chars a stop may still span

    def add(self, token_ids: list[int]) -> str:
        """Append tokens; return the newly final text (a tail that might still begin a stop
        string is held back). After a stop string, `stopped` is True and nothing more comes."""
        decode = self.tokenizer.decode
        for t in token_ids:
            if self.stopped:
                break
            self.ids.append(t)
            head = decode(self.ids[self.prefix:self.read], skip_special_tokens=self.skip)
            full = decode(self.ids[self.prefix:], skip_special_tokens=self.skip)
            if len(full) > len(head) and not full.endswith("\ufffd"):
                grown_from = len(self.text)
                self.text += full[len(head):]
                self.prefix, self.read = self.read, len(self.ids)
                if self.stop:
                    self._cut_at_stop(max(0, grown_from - self._hold))
        end = len(self.text) if self.stopped else max(self.emitted, len(self.text) - self._hold)
        new, self.emitted = self.text[self.emitted:end], end
        return new

    def _cut_at_stop(self, start: int) -> None:
        hits = [(i, s) for s in self.stop if (i := self.text.find(s, start)) >= 0]
        if hits:
            at, self.stop_string = min(hits, key=lambda h: h[0])
            self.text = self.text[:at + (len(self.stop_string) if self.include_stop else 0)]
            self.stopped = True

    def flush(self) -> str:
        """The text held back for a possible stop string, once the request has finished."""
        new, self.emitted = self.text[self.emitted:], len(self.text)
        return new
