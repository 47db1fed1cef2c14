"""Reasoning, split from the answer (`--reasoning-parser think`): models such as Qwen3 and
DeepSeek-R1 think inside `<think>...</think>` before they answer. What is inside goes to
`reasoning_content`, what follows to `content`.

A reply thinks when it opens with `<think>`, or when the prompt ended with one (templates
that open the block for the model); a reply cut off before `</think>` is all reasoning. A
reply that neither opens nor closes a block is all content."""

from __future__ import annotations

from tidal.server.openai.tool_parsers import partial_suffix

OPEN, CLOSE = "<think>", "</think>"
PARSERS = ("think", "qwen3", "deepseek_r1")  # the names vLLM users know map to one parser


class ThinkSplitter:
    """Splits a streamed reply: `feed` and `finish` return (reasoning, content) pieces."""

    def __init__(self, prompt_opens: bool) -> None:
        self._state = "thinking" if prompt_opens else "start"  # then "answer"
        self._held = ""
        self._strip = False  # the newlines right after </think> are not part of the answer

    def feed(self, text: str) -> tuple[str, str]:
        self._held += text
        if self._state == "start":
            head = self._held.lstrip()
            if len(head) < len(OPEN) and OPEN.startswith(head):
                return "", ""  # it may yet open a block
            if not head.startswith(OPEN):
                self._state = "answer"
            else:
                self._state, self._held = "thinking", head[len(OPEN):]
        if self._state == "answer":
            return "", self._answer()
        end = self._held.find(CLOSE)
        if end >= 0:
            reasoning, self._held = self._held[:end], self._held[end + len(CLOSE):]
            self._state, self._strip = "answer", True
            return reasoning, self._answer()
        cut = len(self._held) - partial_suffix(self._held, CLOSE)
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


def reasoning_tokens(tokens: list[int], decode, prompt_opens: bool) -> int:
    """How many of a reply's tokens carry its reasoning: those whose text overlaps the
    block between `<think>` and `</think>` (or the reply's end), markers left out, as the
    Responses API's `output_tokens_details.reasoning_tokens` counts them. `decode` turns a
    list of ids into text, special tokens kept."""
    text = decode(tokens)
    if prompt_opens:
        start = 0
    elif text.lstrip().startswith(OPEN):
        start = text.index(OPEN) + len(OPEN)
    else:
        return 0
    end = text.find(CLOSE, start)
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


def prompt_opens_thinking(prompt_text: str) -> bool:
    """Whether the chat template ended the prompt inside an open `<think>` block."""
    return prompt_text.rstrip().endswith(OPEN)
