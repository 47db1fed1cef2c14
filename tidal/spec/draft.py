"""`draft`: a smaller model with the target's tokenizer guesses by greedy decoding.

Its KV lives in its own cache tensors indexed by the target's block ids: block b holds both
models' KV of the same positions, so the scheduler's pool counts the draft's memory (the
runner sizes each block for both models). Every position the target computes, the draft
computes in the same step, first: prompt chunks, recomputed prompts, and each decode's last
known token. So a prefix-cache hit, a fork's shared blocks or a retracted request's
recompute find the draft's KV as they find the target's. A verifying request's k guesses
come from k greedy draft steps batched over the verifying requests: the first is the
catch-up pass's own logits, and each further step writes the previous guess's KV and reads
the next; the last guess's KV is written too, for the step after an all-accepted run.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch

from tidal.core import ScheduledRequest
from tidal.engine.batch import BatchBuilder, StepBatch, forward
from tidal.engine.config import ModelConfig
from tidal.engine.kv_cache import cache_zeros
from tidal.engine.model_loading import load_for_runner, pick_model_dtype
from tidal.model.attention import TorchAttention, kv_cache_shape
from tidal.model.config import ModelArch


class _Guess:
    """A sequence view whose next token is a guess (what BatchBuilder reads of a decode)."""

    __slots__ = ("token",)

    def __init__(self, token: int) -> None:
        self.token = token

    def tokens(self, start: int, end: int) -> list[int]:
        return [self.token]


def check_same_tokenizer(target: Path, draft: Path) -> None:
    """ValueError unless both folders' tokenizers map the same text to the same ids."""
    from tokenizers import Tokenizer

    def vocab(folder: Path) -> dict[str, int]:
        return Tokenizer.from_file(str(folder / "tokenizer.json")).get_vocab(True)

    if vocab(target) != vocab(draft) or \
            ModelArch.from_folder(target).vocab_size != ModelArch.from_folder(draft).vocab_size:
        raise ValueError(f"the draft model {draft} has another tokenizer or vocabulary than "
                         f"the target {target}: speculation needs the same token ids")


class DraftModel:
    """The draft model, its decoder and its KV caches (made by `allocate`): a `Guesser`
    that always has `max_guesses` guesses."""

    def __init__(self, folder: Path, config: ModelConfig, device: str, ext,
                 max_guesses: int) -> None:
        self.max_guesses = max_guesses
        self.arch = ModelArch.from_folder(folder)
        # (its guesses need not be batch-invariant: verification keeps the target's tokens)
        config = replace(config, model=str(folder), deterministic=False)
        quantization, self.dtype = pick_model_dtype(folder, self.arch, config, device)
        paged = ext.paged_decode_attention if ext else None
        backend = TorchAttention.for_arch(self.arch, paged, None)
        self.model, self.decoder = load_for_runner(folder, self.arch, config, device,
                                                   self.dtype, quantization, backend, ext)
        self.device = device
        self.block_size = 0
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.k_caches: list[torch.Tensor] = []
        self.v_caches: list[torch.Tensor] = []

    def block_bytes(self, block_size: int) -> int:
        return self.arch.kv_bytes_per_token(self.dtype.itemsize) * block_size

    def allocate(self, num_blocks: int, block_size: int) -> None:
        """Caches of `num_blocks` blocks (the pool's and the null block)."""
        self.block_size = block_size
        shape = kv_cache_shape(num_blocks, block_size, self.arch.num_kv_heads,
                               self.arch.head_dim)
        self.k_caches = [cache_zeros(shape, self.dtype, self.device)
                         for _ in range(self.arch.num_layers)]
        self.v_caches = [cache_zeros(shape, self.dtype, self.device)
                         for _ in range(self.arch.num_layers)]
        self.kv_caches = list(zip(self.k_caches, self.v_caches))

    def copy_blocks(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        for k, v in zip(self.k_caches, self.v_caches):
            k[dst] = k[src]
            v[dst] = v[src]

    def propose(self, seq_id: str, prompt: list[int], output: list[int],
                prediction: list[int] | None = None) -> int:
        return self.max_guesses  # computed at the step that verifies them (by the draft)

    def forget(self, seq_id: str, output: list[int], finished: bool) -> None:
        pass  # its KV lives in the target's blocks, freed with them

    @torch.inference_mode()
    def guesses(self, entries: list[ScheduledRequest], seqs: dict, batches: BatchBuilder,
                wanted: dict[str, int]) -> dict[str, list[int]]:
        """Compute the step's known positions, then guess `wanted[id]` tokens for each
        verifying request; its guesses by id."""
        guesses: dict[str, list[int]] = {rid: [] for rid in wanted}
        for part in batches.passes(entries):
            batch = batches.build(part, seqs)
            self._take(batch, self._forward(batch), guesses, wanted)
        by_id = {x.request_id: x for x in entries}
        for j in range(1, max(wanted.values(), default=0) + 1):
            rows = [ScheduledRequest(rid, 1, by_id[rid].num_computed_tokens + j,
                                     by_id[rid].block_ids, True, False)
                    for rid, k in wanted.items() if k >= j]
            batch = batches.build(rows, {x.request_id: _Guess(guesses[x.request_id][j - 1])
                                         for x in rows})
            self._take(batch, self._forward(batch), guesses, wanted)
        return guesses

    @staticmethod
    def _take(batch: StepBatch, logits: torch.Tensor, guesses: dict[str, list[int]],
              wanted: dict[str, int]) -> None:
        """Each verifying row's greedy token, while its request wants more guesses."""
        rows = [(i, rid) for i, rid in enumerate(batch.sample_ids)
                if rid in wanted and len(guesses[rid]) < wanted[rid]]
        if not rows:
            return
        tokens = logits[[i for i, _ in rows]].argmax(-1).tolist()
        for (_, rid), token in zip(rows, tokens):
            guesses[rid].append(token)

    def _forward(self, batch: StepBatch) -> torch.Tensor:
        return forward(self.model, self.decoder, batch, self.kv_caches, self.k_caches,
                       self.v_caches, self.block_size, hidden=False)
