"""Roles of an engine core in prefill/decode disaggregation, as behaviour the scheduler asks
for (what admission allocates, whether a request computes here, what follows its last chunk)
rather than a name it compares."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tidal.core.budget import StepBudget

if TYPE_CHECKING:
    from tidal.core.config import SchedulerConfig
    from tidal.core.request import Request


class Role:
    """`mixed`: serves whole requests, prefill then decode, on this core."""

    name = "mixed"
    concurrent_prefills = False  # several partially prefilled requests at once
    reserves_output = True  # admission keeps blocks for running requests' future output
    hands_off = False  # after its first token a request leaves for KV transfer
    receives_kv = False  # a fresh request's prompt KV and first token come from elsewhere

    @property
    def transfers_kv(self) -> bool:
        """Whether this core is one end of a P/D KV transfer."""
        return self.hands_off or self.receives_kv

    def step_budget(self, config: "SchedulerConfig", num_decoding: int,
                    block_size: int) -> StepBudget:
        """The step's two token budgets; running decodes come off the input budget."""
        return StepBudget(config.chunked_prefill_size,
                          config.max_input_tokens_per_step - num_decoding, block_size)

    def blocks_for(self, num_new: int, num_remaining: int) -> int:
        """Prompt tokens admission allocates blocks for: this step's chunk."""
        return num_new

    def decoding(self, running: list["Request"]) -> list["Request"]:
        """The running requests a step may decode: those past their prompt."""
        return [r for r in running if r.num_computed_tokens >= r.prefill_target]

    def kv_arrives(self, request: "Request") -> bool:
        """Whether the request's prompt KV is computed elsewhere: it takes blocks, no tokens.
        A request retracted here (it has output already) recomputes its prompt locally."""
        return self.receives_kv and not request.output_token_ids

    def refusal(self, prefill_address: str | None, prompt_only: bool = False) -> str | None:
        """Why a request from this core's own frontend cannot start here (None: it can);
        `prompt_only`: it ends at its prompt (an embedding or a score), nothing to decode."""
        return None


class PrefillRole(Role):
    """`prefill`: computes prompts only. Every prompt takes all its blocks up front (so this
    core never retracts), many prompts may be mid-chunk at once under the whole input
    budget, and after its first token a request leaves for its decode instance."""

    name = "prefill"
    concurrent_prefills = True
    reserves_output = False
    hands_off = True

    def step_budget(self, config, num_decoding, block_size):
        tokens = config.max_input_tokens_per_step  # no decodes run here
        return StepBudget(tokens, tokens, block_size)

    def blocks_for(self, num_new, num_remaining):
        return num_remaining

    def decoding(self, running):
        # a request leaves at its first token, also when a step ahead was planned before
        # that token came back: its blocks are read for the transfer, nothing writes them
        return []

    def refusal(self, prefill_address, prompt_only=False):
        if prompt_only:  # computing prompts is this role's work: no KV moves
            return None
        return ("this is a prefill instance: requests come through `tidal router`, which "
                "sends them to a decode instance")


class DecodeRole(Role):
    """`decode`: a new request's prompt KV and first token come from a prefill instance;
    only a request retracted here (it has output already) recomputes its prompt locally."""

    name = "decode"
    receives_kv = True

    def refusal(self, prefill_address, prompt_only=False):
        if prompt_only:
            return ("this is a decode instance: embeddings and scores are computed by the "
                    "prefill instances (through `tidal router`)")
        if prefill_address:
            return None
        return ("this is a decode instance: requests come through `tidal router` "
                "(kv_transfer_params.prefill_address)")


ROLES = {role.name: role for role in (Role(), PrefillRole(), DecodeRole())}
