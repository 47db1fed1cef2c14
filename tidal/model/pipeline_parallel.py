"""Pipeline parallelism: each stage holds a contiguous run of the layers (and their KV
cache), the step's hidden states go from stage to stage, and the last stage's final
states come back to every stage, which computes the logits (every stage holds the
embedding, the final norm and the LM head) and samples the same tokens, as tensor-parallel
ranks do: a rank's runner needs no word from the others beside the step's plan.

A step runs its stages one after another (one batch in flight). Each rank of a stage
sends to the rank of the same tensor-parallel place in the next (each holds the whole
hidden states after its all-reduces)."""

from __future__ import annotations

import torch
import torch.distributed as dist


class StageLinks:
    """Rank `rank`'s place in a pipeline of `stages` stages of `width` ranks each (global
    rank = stage * width + tensor-parallel rank): the ranks its hidden states come from
    and go to, and its group with the same place in every stage (`column`), over which
    the last stage's final states are broadcast."""

    def __init__(self, rank: int, width: int, stages: int, column) -> None:
        self.stage, place = divmod(rank, width)
        self.stages, self.column = stages, column
        self.prev = rank - width if self.stage > 0 else None
        self.next = rank + width if self.stage < stages - 1 else None
        self.last_rank = (stages - 1) * width + place

    @property
    def first(self) -> bool:
        return self.prev is None

    @property
    def last(self) -> bool:
        return self.next is None

    def receive(self, rows: int, hidden: int, dtype: torch.dtype) -> torch.Tensor:
        """The previous stage's hidden states of a step's `rows` tokens."""
        h = torch.empty(rows, hidden, dtype=torch.float32)  # float32 on the wire
        dist.recv(h, src=self.prev)
        return h.to(dtype)

    def send(self, h: torch.Tensor) -> None:
        """This stage's hidden states to the next stage."""
        dist.send(h.float().contiguous(), dst=self.next)

    def from_last(self, x: torch.Tensor) -> torch.Tensor:
        """The last stage's `x` on every stage (this stage's `x` gives the shape)."""
        wide = x.float().contiguous()
        dist.broadcast(wide, src=self.last_rank, group=self.column)
        return x if self.last else wide.to(x.dtype)
