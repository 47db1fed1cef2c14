"""Reasoning, split from the answer (`--reasoning-parser think`): models such as Qwen3 and
DeepSeek-R1 think inside `<think>...</think>` before they answer, Magistral inside
`[THINK]...[/THINK]`, Seed-OSS inside `<seed:think>...</seed:think>`. What is inside goes
to `reasoning_content`, what follows to `content`.

A reply thinks when it opens with the block's marker, or when the prompt ended with one
(templates that open the block for the model); a reply cut off before the closing marker is
all reasoning. A reply that neither opens nor closes a block is all content."""

from __future__ import annotations

from typing import NamedTuple

from tidal.server.openai.tool_parsers import partial_suffix


class Markers(NamedTuple):
    """A reasoning block's opening and closing text; `special`: they are special tokens,
    whose text a reply keeps only with skip_special_tokens off (the server turns it off for
    chat requests, as for a tool parser's marker)."""

    open: str
    close: str
    special: bool = False


THINK = Markers("<think>", "</think>")
# --reasoning-parser's names (vLLM's, for the models that use each block) -> its markers
MARKERS = {"think": THINK, "qwen3": THINK, "deepseek_r1": THINK,
           "mistral": Markers("[THINK]", "[/THINK]", special=True),
           "seed_oss": Markers("<seed:think>", "</seed:think>")}
PARSERS = tuple(MARKERS)


class ThinkSplitter:
    """Splits a streamed reply: `feed` and `finish` return (reasoning, content) pieces."""

    def __init__(self, prompt_opens: bool, markers: Markers = THINK) -> None:
        self.markers = markers
        self._state = "thinking" if prompt_opens else "start"  # then "answer"
        self._held = ""
        self._strip = False  # the newlines right after </think> are not part of the answer

    def feed(self, text: str) -> tuple[str, str]:
        self._held += text
        opening, closing = self.markers[:2]
        if self._state == "start":
            head = self._held.lstrip()
            if len(head) < len(opening) and opening.startswith(head):
                return "", ""  # it may yet open a block
            if not head.startswith(opening):
                self._state = "answer"
            else:
                self._state, self._held = "thinking", head[len(opening):]
        if self._state == "answer":
            return "", self._answer()
        end = self._held.find(closing)
        if end >= 0:
            reasoning, self._held = self._held[:end], self._held[end + len(closing):]
            self._state, self._strip = "answer", True
            return reasoning, self._answer()
        cut = len(self._held) - partial_suffix(self._held, closing)
        reasoning, self._held = self._held[:cut], self._held[cut:]
        return reasoning, ""

    def finish(self) -> tuple[str, str]:
        if self._state == "thinking":
            held, self._held = self._held, ""
            return held, ""
        return "", self._answer()

    def _answer(self) -> str:
        text, self._held = self._held, ""
        if self._strip:
            text = text.lstrip("\n")
            self._strip = not text
        return text


def reasoning_tokens(tokens: list[int], decode, prompt_opens: bool,
                     markers: Markers = THINK) -> int:
    """How many of a reply's tokens carry its reasoning: those whose text overlaps the
    block between its markers (or the reply's end), markers left out, as the Responses
    API's `output_tokens_details.reasoning_tokens` counts them. `decode` turns a list of
    ids into text, special tokens kept."""
    opening, closing = markers[:2]
    text = decode(tokens)
    if prompt_opens:
        start = 0
    elif text.lstrip().startswith(opening):
        start = text.index(opening) + len(opening)
    else:
        return 0
    end = text.find(closing, start)
    end = len(text) if end < 0 else end
    if end <= start:
        return 0

    def first(reach: int) -> int:
        """The fewest leading tokens whose text reaches past `reach` characters."""
        lo, hi = 0, len(tokens)
        while lo < hi:
            mid = (lo + hi) // 2
            if len(decode(tokens[:mid])) > reach:
                hi = mid
            else:
                lo = mid + 1
        return lo

    # token i overlaps [start, end) when its prefix ends past start and begins before end
    return first(end - 1) - first(start) + 1


def prompt_opens_thinking(prompt_text: str, markers: Markers = THINK) -> bool:
    """Whether the chat template ended the prompt inside an open reasoning block."""
    return prompt_text.rstrip().endswith(markers.open)
