"""The one interface the model runner speculates through (`tree.py` verifies the guesses).

A `Guesser` hands the runner each verifying request's guesses before the forward pass, and
after sampling says how many it holds for the next step. Two kinds implement it:
`Speculator` (a `Proposer` beside the runner: ngram, suffix; an EAGLE or MTP head would be
one more proposer) and `DraftModel` (a smaller model with KV of its own in the target's
block ids). The runner never branches on which it has.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

    from tidal.core import ScheduledRequest
    from tidal.spec.tree import GuessTree


class Guesser(Protocol):
    """Guesses for the runner's verifying requests, by request id."""

    max_guesses: int

    def block_bytes(self, block_size: int) -> int:
        """KV bytes a block of `block_size` positions holds for the guesser (0: none)."""
        ...

    def allocate(self, num_blocks: int, block_size: int) -> None:
        """Its KV cache of the pool's blocks (and the null block), if it keeps one."""
        ...

    def copy_blocks(self, src: "torch.Tensor", dst: "torch.Tensor") -> None:
        """Copy its KV of blocks `src` to `dst`, as the target's are copied."""
        ...

    def guesses(self, scheduled: "list[ScheduledRequest]", seqs: dict, batches,
                wanted: dict[str, int]) -> "dict[str, GuessTree | list[int]]":
        """Up to `wanted[id]` guesses for each verifying request of the step, a tree or one
        path (`seqs`: the runner's requests; `batches`: its BatchBuilder, for a guesser that
        runs a model)."""
        ...

    def propose(self, seq_id: str, prompt: list[int], output: list[int],
                prediction: list[int] | None = None) -> int:
        """Guess ahead of `output` for the sequence's next step (from its predicted output
        first, where it has one and the guesser reads them); returns how many."""
        ...

    def forget(self, seq_id: str, output: list[int], finished: bool) -> None:
        """The sequence left the runner: finished, or retracted ([] output: it comes back)."""
        ...

