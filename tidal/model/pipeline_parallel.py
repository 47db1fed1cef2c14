"""Pipeline parallelism: each stage holds a contiguous run of the layers (and their KV
cache), the step's hidden states go from stage to stage, and every stage samples the same
tokens from the same logits, as tensor-parallel ranks do: a rank's runner needs no word
from the others beside the step's plan. Where the stages share a machine, the last stage
computes the logits and sends them to the others (the head once, not on every stage of
the same cores); across machines it sends its final states, and each stage computes the
logits itself (every stage holds the embedding, the final norm and the LM head).

Each rank of a stage sends to the rank of the same tensor-parallel place in the next (each
holds the whole hidden states after its all-reduces). With one batch in flight a step runs
its stages in turn. With several (`pipelined`), a stage before the last returns a `Pending`
step after sending its states on, and takes the last stage's final states only when the
step completes, after starting the next: so stage 0 computes step B while stage 1 computes
step A (the scheduler keeps their requests apart)."""

from __future__ import annotations

from collections import deque

import torch
import torch.distributed as dist


class StageLinks:
    """Rank `rank`'s place in a pipeline of `stages` stages of `width` ranks each (global
    rank = stage * width + tensor-parallel rank): the ranks its hidden states come from
    and go to, and its group with the same place in every stage (`column`), over which
    the last stage broadcasts a step's end (its logits, or its final states)."""

    def __init__(self, rank: int, width: int, stages: int, column, local: bool = False,
                 ) -> None:
        """`local`: the column's ranks share one machine (the last stage sends logits)."""
        self.stage, place = divmod(rank, width)
        self.stages, self.column, self.local = stages, column, local
        self.vocab = 0  # the logits' width (the whole vocabulary's), set with the model
        self.prev = rank - width if self.stage > 0 else None
        self.next = rank + width if self.stage < stages - 1 else None
        self.last_rank = (stages - 1) * width + place
        self.pipelined = False  # several steps in flight: earlier stages defer their end
        self._sends: list = []  # broadcasts under way (their work and tensor kept alive)
        # states sent on (number, work, tensor) until known taken: gloo reports a send done
        # only once waited on, so holding them until `is_completed` would hold every one
        self._sent: deque = deque()
        self._numbered = 0

    @property
    def defers(self) -> bool:
        """Whether a step's end here waits for its completion (`Pending`)."""
        return self.pipelined and not self.last

    @property
    def held(self) -> int:
        """Operations under way whose tensors this stage still holds."""
        return len(self._sends) + len(self._sent)

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

    def send(self, h: torch.Tensor) -> int:
        """This stage's hidden states to the next stage, without waiting for it to take
        them (the next stage may still be finishing an earlier step): the send's number."""
        wire = h.float().contiguous()
        self._numbered += 1
        self._sent.append((self._numbered, dist.isend(wire, dst=self.next), wire))
        return self._numbered

    def _taken(self, upto: int) -> None:
        """Let go of the sends numbered up to `upto`: the last stage has ended the pass of
        the last of them, so the next stage took them all (in order)."""
        while self._sent and self._sent[0][0] <= upto:
            self._sent.popleft()[1].wait()

    def from_last(self, x: torch.Tensor) -> torch.Tensor:
        """The last stage's `x` on every stage (this stage's `x` gives the shape). The last
        stage does not wait for the others to take it: they take it when the step
        completes, after launching later steps."""
        wide = x.float().contiguous()
        if self.last:
            self._keep(dist.broadcast(wide, src=self.last_rank, group=self.column,
                                      async_op=True), wide)
            return x
        dist.broadcast(wide, src=self.last_rank, group=self.column)
        return wide.to(x.dtype)

    def start(self, ids: torch.Tensor, hidden: int, dtype: torch.dtype) -> torch.Tensor | None:
        """A step's input here: the previous stage's states of its `ids`' rows, or None on
        the first stage (which embeds the ids)."""
        return None if self.first else self.receive(ids.shape[0], hidden, dtype)

    def finish(self, states: torch.Tensor, final: torch.Tensor, head,
               hidden: torch.Tensor | None = None):
        """A step's end here: `states` (the residual stream) on to the next stage, then
        `head(final states, hidden)` of the last stage's `final` (and `hidden`) states,
        those of this stage giving the shapes; `Pending` where this stage defers."""
        sent = 0 if self.last else self.send(states)

        def end():
            out = self._logits_from_last(final, head, hidden) if self.local else head(
                self.from_last(final), None if hidden is None else self.from_last(hidden))
            self._taken(sent)
            return out
        return Pending(end) if self.defers else end()

    def _logits_from_last(self, final: torch.Tensor, head, hidden: torch.Tensor | None):
        """`head`'s result as the last stage computes it, on every stage: its logits
        broadcast (and its `hidden` states, which the caller heads in slices)."""
        if self.last:
            out = head(final, hidden)
            logits = out if hidden is None else out[0]
            wire = logits.clone()  # the sampler may scale its logits in place meanwhile
            self._keep(dist.broadcast(wire, src=self.last_rank, group=self.column,
                                      async_op=True), wire)
            if hidden is not None:
                self.from_last(hidden)
            return out
        logits = torch.empty(final.shape[0], self.vocab, dtype=torch.float32)
        dist.broadcast(logits, src=self.last_rank, group=self.column)
        return logits if hidden is None else (logits, self.from_last(hidden))

    def _keep(self, work, tensor: torch.Tensor) -> None:
        """Hold an operation under way, and its tensor, until it is done."""
        self._sends = [(w, t) for w, t in self._sends if not w.is_completed()]
        self._sends.append((work, tensor))


class Pending:
    """A forward pass whose end (the last stage's final states, and the logits from them)
    is taken when its step completes: `result()` once."""

    def __init__(self, finish) -> None:
        self.finish = finish

    def result(self):
        return self.finish()
