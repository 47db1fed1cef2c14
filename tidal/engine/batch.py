"""A step's entries as forward passes: the flattened batch of token ids, positions, cache
slots and attention metadata the model reads, in the runner's persistent step inputs."""

from __future__ import annotations

import torch

from tidal.core import ScheduledRequest
from tidal.engine.decode_graphs import DecodeGraphs
from tidal.engine.step_inputs import StepInputs
from tidal.model.attention import (AttentionBackend, AttentionMetadata, PrefillSeq,
                                   prefix_causal_mask)
from tidal.spec.tree import GuessTree


class BatchBuilder:
    """Splits a step into passes and builds each pass's `StepBatch`. `seqs` maps a request
    to the runner's copy of it (its tokens, and `prompt_k` while prompt logprobs are owed)."""

    def __init__(self, block_size: int, null_block: int, device: str,
                 backend: AttentionBackend, inputs: StepInputs,
                 max_forward_tokens: int) -> None:
        self.block_size, self.null_block, self.device = block_size, null_block, device
        self.backend, self.inputs = backend, inputs
        self.max_forward_tokens = max_forward_tokens

    def passes(self, scheduled: list[ScheduledRequest]) -> list[list[ScheduledRequest]]:
        """The step's entries, prefills first, in forward passes of at most
        max_forward_tokens tokens (an entry over the limit runs alone). Each sequence attends
        only to itself, so the passes compute what one pass would."""
        limit = self.max_forward_tokens
        if not limit or sum(s.num_new_tokens for s in scheduled) <= limit:
            return [scheduled]
        passes: list[list[ScheduledRequest]] = [[]]
        size = 0
        for s in sorted(scheduled, key=lambda s: not s.is_prefill):
            if passes[-1] and size + s.num_new_tokens > limit:
                passes.append([])
                size = 0
            passes[-1].append(s)
            size += s.num_new_tokens
        return passes

    def build(self, entries: list[ScheduledRequest], seqs: dict,
              graphs: DecodeGraphs | None = None,
              guesses: dict[str, GuessTree] | None = None) -> StepBatch:
        """The flattened batch: prefill entries first (one contiguous run each), then the
        decodes, one row per position (a decode verifying `guesses[id]` has a row for its
        last token and one for each guess); a decode-only batch that fits a graph, and
        verifies no tree, is padded to its bucket."""
        batch = StepBatch()
        self._prefills(batch, [s for s in entries if s.is_prefill], seqs)
        self._decodes(batch, [s for s in entries if not s.is_prefill], seqs,
                      None if batch.prefills else graphs, guesses or {})
        put = self.inputs.put
        self.inputs.begin()
        if batch.lens is not None:
            batch.tables = put("tables", batch.tables, batch.width)
            batch.lens = put("lens", batch.lens)
        if batch.prefill_tables:
            self._prefill_inputs(batch)
        tree = (put("tree", [v for row in batch.tree for v in row], 2)
                if batch.tree is not None else None)
        batch.meta = AttentionMetadata(put("slots", batch.slots), batch.prefills,
                                       batch.num_prefill_tokens, batch.tables, batch.bias,
                                       batch.max_len, batch.lens, tree, **batch.prefill_meta)
        batch.input_ids = put("ids", batch.ids)
        batch.positions = put("positions", batch.pos)
        batch.logits_indices = put("rows", batch.logits_rows)
        if batch.prompt_rows or batch.pool_rows:
            batch.hidden_indices = put("hidden", batch.prompt_rows + batch.pool_rows)
        if batch.twice_rows:
            batch.twice = (put("twice", batch.twice_rows), put("twice_head", batch.twice_head))
        self.inputs.end()
        return batch

    def _prefills(self, batch: StepBatch, entries: list[ScheduledRequest], seqs: dict) -> None:
        """Each chunk's tokens and slots; a chunk after cached tokens (an earlier chunk, a
        prefix-cache hit) attends to them through its block table. With a paged prefill
        kernel (Triton on CUDA, C++ on CPU) and a chunk that reads cached tokens, or a fresh
        run of at least the backend's `fresh_kernel_scores`, every chunk of the step reads
        its context through the step's padded tables."""
        bs, dev = self.block_size, self.device
        ids, slots = batch.ids, batch.slots
        backend = self.backend
        fresh = backend.fresh_kernel_scores
        kernel = backend.prefill_kernel is not None and (
            any(s.num_computed_tokens for s in entries)
            or (fresh is not None and any(s.num_new_tokens ** 2 >= fresh for s in entries)))
        for s in entries:
            c, n, table = s.num_computed_tokens, s.num_new_tokens, s.block_ids
            start = len(ids)
            q = seqs[s.request_id]
            ids.extend(q.tokens(c, c + n))
            if q.prompt_k is not None:  # every row but the prompt's last predicts a prompt token
                count = max(0, min(c + n, len(q.prompt) - 1) - c)
                batch.prompt_rows.extend(range(start, start + count))
                batch.prompt_spans.append((s.request_id, c, count))
            if q.embed is not None:  # every row: the pooling keeps what it reads
                batch.pool_spans.append((s.request_id, c, len(batch.pool_rows), n))
                batch.pool_rows.extend(range(start, start + n))
            batch.spans.append((s.request_id, start, n))
            prompt = max(0, min(c + n, len(q.prompt)) - c)  # a preemption's recompute: fewer
            batch.twice_rows.extend(range(start, start + prompt))
            pos = range(c, c + n)
            batch.pos.extend(pos)
            slots.extend(table[p // bs] * bs + p % bs for p in pos)
            if kernel:
                batch.prefills.append(PrefillSeq(start, n, c))
                batch.prefill_tables.append(table)
            elif c == 0:
                batch.prefills.append(PrefillSeq(start, n, 0))
            else:  # attends to its cached prefix too: causal from position c on
                batch.prefills.append(PrefillSeq(start, n, c, torch.tensor(table, device=dev),
                                                 prefix_causal_mask(c, n, dev)))
            if s.samples:
                if prompt == n:
                    batch.twice_head.append(len(batch.logits_rows))
                batch.logits_rows.append(start + n - 1)
                batch.sample_ids.append(s.request_id)
        batch.num_prefill_tokens = len(ids)

    def _prefill_inputs(self, batch: StepBatch) -> None:
        """The paged prefill kernel's tables (padded with the null block), query starts and
        context lengths, on the device."""
        put, seqs = self.inputs.put, batch.prefills
        width = max(len(t) for t in batch.prefill_tables)
        flat = [b for t in batch.prefill_tables for b in t + [self.null_block] * (width - len(t))]
        batch.prefill_meta = dict(
            prefill_tables=put("prefill_tables", flat, width),
            query_starts=put("query_starts", [s.start for s in seqs] + [batch.num_prefill_tokens]),
            prefill_lens=put("prefill_lens", [s.cached + s.length for s in seqs]),
            max_query_len=max(s.length for s in seqs))

    def _decodes(self, batch: StepBatch, entries: list[ScheduledRequest], seqs: dict,
                 graphs: DecodeGraphs | None, guesses: dict[str, GuessTree]) -> None:
        """One row per position, with block tables padded (with the null block) to a common
        width for paged attention. A guess's row is a decode row like any other: it writes
        its K/V, then attends to the context up to itself, so a verification's rows are
        causal among themselves; a tree's rows (`GuessTree`) take its slots in order and
        their positions by depth, and see only their own branch (`batch.tree`). With
        `graphs`, padded to the bucket of a captured graph by rows that read and write the
        null block alone."""
        if not entries:
            return
        bs, null = self.block_size, self.null_block
        width = max(len(s.block_ids) for s in entries)
        tables, lens = [], []
        pad_table = [null] * width
        trees = any(not g.is_chain() for g in guesses.values())
        tree_rows = batch.tree = [] if trees else None
        for s in entries:
            c, table, rid = s.num_computed_tokens, s.block_ids, s.request_id
            own = table + pad_table[len(table):]
            g = guesses.get(rid)
            row_tokens = seqs[rid].tokens(c, c + 1) + (g.tokens if g is not None else [])
            depths = [0] + g.depths() if g is not None else [0]
            batch.spans.append((rid, len(batch.ids), len(row_tokens)))
            for i, token in enumerate(row_tokens):
                slot = c + i  # a tree node's position is its depth's, its slot its own
                batch.ids.append(token)
                batch.pos.append(c + depths[i])
                batch.slots.append(table[slot // bs] * bs + slot % bs)
                tables += own
                lens.append(slot + 1)
                batch.logits_rows.append(len(batch.ids) - 1)  # every decode row samples
                batch.sample_ids.append(rid)
            if tree_rows is not None:
                bits = [1] + (g.visible() if g is not None and not g.is_chain() else [])
                tree_rows += [(c, _int64(b)) for b in bits]
                tree_rows += [(c + i + 1, 0) for i in range(len(bits), len(row_tokens))]
        rows = len(lens)
        bucket = graphs.bucket(rows, width) if graphs and not trees else None
        if bucket is not None:
            pad = bucket - rows
            batch.ids += [0] * pad
            batch.pos += [0] * pad
            batch.slots += [null * bs] * pad
            tables += [null] * (width * pad)
            lens += [1] * pad
            batch.graph = True
        batch.tables, batch.width, batch.lens, batch.max_len = tables, width, lens, max(lens)
        batch.bias = self.backend.decode_bias(lens, width * bs, self.device, tree_rows)


def _int64(bits: int) -> int:
    """A 64-bit mask as the signed integer an int64 tensor holds."""
    return bits - (1 << 64) if bits >= 1 << 63 else bits


def forward(model, decoder, batch: "StepBatch", kv_caches: list, k_caches: list,
            v_caches: list, block_size: int, hidden: bool = True, lora=None):
    """The batch's logits through one C++ decoder call where the step is decode-only and
    the model has a decoder, else through the PyTorch model (with the final hidden states
    of the prompt-logprob rows, then of the pooled rows, as (logits, hidden), when `hidden`
    and the batch has such rows). `kv_caches`: a (K, V) pair per layer; `k_caches`,
    `v_caches` the same tensors as two lists (what the decoder takes). `lora`: the pass's
    LoRABatch (the PyTorch model's LoRA projections read it themselves)."""
    meta = batch.meta
    if model.prompt_rows is not None:  # the GGUF layers round these rows twice
        rows, head = batch.twice
        model.prompt_rows.set(rows, len(batch.ids), head, len(batch.logits_rows))
    if decoder is not None and not meta.prefills:
        rows = lora.rows if lora is not None else None
        adapters = () if rows is None else (rows, lora.ends)  # the rows that carry one
        tree = {} if meta.decode_tree is None else {"tree": meta.decode_tree}
        return decoder.forward(batch.input_ids, batch.positions, meta.slot_mapping,
                               meta.decode_block_tables, meta.decode_lens, k_caches, v_caches,
                               batch.logits_indices, model.backend.scale, block_size,
                               *adapters, **tree)
    return model(batch.input_ids, batch.positions, kv_caches, meta, batch.logits_indices,
                 batch.hidden_indices if hidden else None)


class StepBatch:
    """One forward pass's inputs, filled by the prefill then the decode preparation."""

    def __init__(self) -> None:
        self.ids: list[int] = []
        self.pos: list[int] = []
        self.slots: list[int] = []
        self.prefills: list[PrefillSeq] = []
        self.spans: list[tuple[str, int, int]] = []  # (request, first row, rows)
        self.num_prefill_tokens = 0
        self.logits_rows: list[int] = []
        self.sample_ids: list[str] = []
        self.prompt_rows: list[int] = []  # rows whose next-token logprobs a prompt asked for
        self.prompt_spans: list[tuple[str, int, int]] = []  # (request, first position, rows)
        self.pool_rows: list[int] = []  # rows of prompts whose embedding is owed
        # (request, first position, its first row in pool_rows, rows)
        self.pool_spans: list[tuple[str, int, int, int]] = []
        self.hidden_indices = None
        self.twice_rows: list[int] = []  # rows of prompt tokens (PromptRows)
        self.twice_head: list[int] = []  # the logits rows among them
        self.twice = (None, None)  # both on the device, when there are any
        self.tables = self.bias = self.lens = None  # decode-only fields
        self.tree: list[tuple[int, int]] | None = None  # (start, bits) per decode row
        self.max_len = self.width = 0
        self.graph = False  # runs through a captured decode graph
        self.prefill_tables: list[list[int]] = []  # for a paged prefill kernel
        self.prefill_meta: dict = {}
        self.input_ids = self.positions = self.meta = self.logits_indices = None
