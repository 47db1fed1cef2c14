"""The step being planned: its token budgets, the outcome of trying to admit a request, and
the plan that holds both."""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tidal.core.outputs import SchedulerOutput


class Admission(enum.Enum):
    """Why a request was or was not given tokens this step."""

    ADMITTED = "admitted"
    NO_MEMORY = "no_memory"  # blocks (with reservations) do not cover it; wait for frees
    BUDGET_EXHAUSTED = "budget_exhausted"  # token budget, chunk slot or max_num_seqs is used up
    NO_ADAPTER_SLOT = "no_adapter_slot"  # its LoRA adapter would exceed max_loras this step


class StepBudget:
    """The two token budgets of one step.

    `rem_input_tokens` bounds every token the step computes (running decodes are taken off
    up front). `rem_chunk_tokens` bounds the one truncated (chunked) prefill: a request whose
    remaining prompt fits both budgets is taken whole and spends only `rem_input_tokens`; one
    that does not is cut to a block-aligned chunk that spends both.
    """

    __slots__ = ("rem_chunk_tokens", "rem_input_tokens", "block_size")

    def __init__(self, chunk_tokens: int, input_tokens: int, block_size: int) -> None:
        self.rem_chunk_tokens = chunk_tokens
        self.rem_input_tokens = input_tokens
        self.block_size = block_size

    def fits_whole(self, num_tokens: int) -> bool:
        return num_tokens <= min(self.rem_chunk_tokens, self.rem_input_tokens)

    def chunk_size(self, num_computed: int, num_remaining: int) -> int:
        """Tokens to give a request now: all that remain if they fit, else the largest chunk
        whose end lands on a block boundary (0 if none fits)."""
        if self.fits_whole(num_remaining):
            return num_remaining
        limit = min(self.rem_chunk_tokens, self.rem_input_tokens, num_remaining)
        end = (num_computed + limit) // self.block_size * self.block_size
        return max(0, end - num_computed)

    def spend(self, num_tokens: int, chunked: bool) -> None:
        self.rem_input_tokens -= num_tokens
        if chunked:
            self.rem_chunk_tokens -= num_tokens


class StepPlan:
    """The step being planned: its output, its budgets, and what it holds so far."""

    __slots__ = ("out", "budget", "reserved_tokens", "preempted", "num_decodes", "num_prefills",
                 "max_seqs", "adapters", "live_only")

    def __init__(self, out: SchedulerOutput, budget: StepBudget, max_seqs: int) -> None:
        self.out = out
        self.budget = budget
        self.max_seqs = max_seqs  # requests that may hold blocks once this step is admitted
        self.reserved_tokens = 0.0  # decode reservation of running + admitted this step
        self.preempted = False
        self.num_decodes = 0
        self.num_prefills = 0
        self.adapters: set[str] = set()  # LoRA adapters of the requests holding blocks
        self.live_only = False  # no background request is admitted (a live prompt's step)

    def kind(self) -> str:
        if self.num_prefills:
            return "mixed" if self.num_decodes else "prefill"
        return "decode" if self.num_decodes else "idle"
