"""What a request's prompt gives back besides its KV cache: prompt logprobs and a pooled
embedding. Both are gathered chunk by chunk from the forward passes' final hidden states
and handed over with the request's first sampled token."""

from __future__ import annotations

import torch

from tidal.core import ModelOutput
from tidal.engine.batch import StepBatch
from tidal.model.pooling import Pooling
from tidal.model.sampler import target_logprobs


class PromptOutputs:
    """Prompt logprobs and pooling for the runner's requests (`seqs`: its `_Seq`s)."""

    def __init__(self, model, pooling: Pooling) -> None:
        self.model, self.pooling = model, pooling

    def gather(self, batch: StepBatch, hidden: torch.Tensor | None, seqs: dict) -> None:
        """Fold a pass's hidden states in: its prompt-logprob rows first, then the pooled
        rows."""
        if batch.prompt_spans:
            self._prompt_logprobs(batch, hidden, seqs)
        if batch.pool_spans:
            self._pool(batch, hidden[len(batch.prompt_rows):], seqs)

    def hand_over(self, rid: str, q, result: ModelOutput) -> None:
        """With a request's first token: the prompt logprobs and the embedding it is owed."""
        if q.prompt_k is not None:
            result.prompt_logprobs[rid] = q.prompt_entries
            q.prompt_k, q.prompt_entries = None, []
        if q.embed is not None:
            result.embeddings[rid] = (self.pooling.score(q.pooled) if q.params.score else
                                      self.pooling.finish(q.pooled, q.embed))
            q.embed, q.pooled = None, None

    def _prompt_logprobs(self, batch: StepBatch, hidden: torch.Tensor, seqs: dict) -> None:
        """Each chunk's prompt logprobs, appended to its request's: row p of a chunk gives
        position p + 1's entry (the next chunk's first token is known: it is the prompt)."""
        offset = 0
        rows = self.model.prompt_rows  # each row is a prompt token's
        logits_of = self.model.logits if rows is None else rows.every_row(self.model.logits)
        for rid, c, count in batch.prompt_spans:
            q = seqs[rid]
            if c == 0:
                q.prompt_entries.append(None)  # position 0 has no context to predict it
            if count:
                q.prompt_entries += target_logprobs(
                    logits_of, hidden[offset:offset + count],
                    q.prompt[c + 1:c + 1 + count], q.prompt_k)
                offset += count

    def _pool(self, batch: StepBatch, hidden: torch.Tensor, seqs: dict) -> None:
        """Fold each embedding request's chunk of final hidden states into its pooling."""
        for rid, c, row, count in batch.pool_spans:
            q = seqs[rid]
            q.pooled = self.pooling.add(q.pooled, hidden[row:row + count], c, len(q.prompt))
