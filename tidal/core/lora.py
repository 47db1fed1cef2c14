"""Which LoRA adapters a step may hold, and how long a request may be passed over for one.

The model runner holds `max_loras` adapters in its slots, and every request holding KV
blocks runs in each step, so those requests may use at most `max_loras` distinct adapters
(requests of the base model use none). Admission stays first come, first served within
that constraint: a waiting request whose adapter finds no free slot is skipped, and later
requests whose adapters are resident (or that fit a free slot) are admitted past it, for at
most `lora_wait_steps` steps since it was queued. After that nobody behind it is admitted,
so the resident adapters drain and a slot frees up for it: no adapter starves.
"""

from __future__ import annotations

from typing import Iterable

from tidal.core.request import Request


class AdapterSlots:
    """The slot rule of one scheduler (pure bookkeeping; the runner owns the weights)."""

    __slots__ = ("max_loras", "wait_steps", "seen")

    def __init__(self, max_loras: int, wait_steps: int) -> None:
        self.max_loras = max_loras
        self.wait_steps = wait_steps
        self.seen = False  # a request with an adapter has arrived: the rule has work to do

    def note(self, request: Request) -> None:
        if request.lora is not None:
            self.seen = True

    def adapters_of(self, requests: Iterable[Request]) -> set[str]:
        """The adapters these requests use (those holding blocks: the slots in use)."""
        if not self.seen:
            return set()
        return {r.lora for r in requests if r.lora is not None}

    def claim(self, held: set[str], request: Request) -> bool:
        """Whether admitting `request` keeps the step within max_loras adapters; if so its
        adapter joins `held`."""
        lora = request.lora
        if lora is None or lora in held:
            return True
        if len(held) >= self.max_loras:
            return False
        held.add(lora)
        return True

    def may_be_passed(self, request: Request, step: int) -> bool:
        """Whether requests behind `request` (refused a slot) may still be admitted."""
        return step - request.enqueue_step < self.wait_steps
