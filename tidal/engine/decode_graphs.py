"""CUDA graphs for decode-only steps.

A decode step's work is the same kernels for a given batch size, so each batch-size bucket
is captured once at start-up and replayed: one launch instead of hundreds. A step of B
decodes runs in the smallest bucket >= B; its padding rows read and write only the null
KV block (an extra block the pool never hands out) and their logits are dropped. Graphs
read static input tensors, so a step copies its inputs into them first (device to device).
Mixed and prefill steps, and batches above the largest bucket, run eagerly."""

from __future__ import annotations

from functools import partial
from typing import Callable, Protocol

import torch

from tidal.model.attention import AttentionMetadata


def graph_buckets(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, 16, 24, 32, 48, 64, then every 32 up to max_num_seqs (included)."""
    sizes = [1, 2, 4, 8, 16, 24, 32, 48, 64]
    while sizes[-1] < max_num_seqs:
        sizes.append(sizes[-1] + 32)
    return [b for b in sizes if b < max_num_seqs] + [max_num_seqs]


class CaptureBackend(Protocol):
    def capture(self, fn: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        """Record `fn` over its static inputs; the result replays it, returning its output
        tensor (refilled in place by each replay)."""


class CudaGraphCapture:
    """torch.cuda.CUDAGraph, every bucket's graph in one memory pool (captured largest
    first, so the smaller ones reuse its blocks)."""

    def __init__(self) -> None:
        self.pool = None

    def capture(self, fn):
        fn()  # warm-up: compiles kernels, sets up cuBLAS workspaces outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = fn()
        self.pool = graph.pool()

        def replay() -> torch.Tensor:
            graph.replay()
            return out
        return replay


class EagerReplay:
    """A capture backend whose replay runs the function again over the same static inputs:
    the bucketing, padding and null-block logic without CUDA (tests; CPU)."""

    def capture(self, fn):
        return fn


class DecodeGraphs:
    """One replayable decode step per bucket, over static inputs sized for the largest.
    `model(ids, positions, kv_caches, meta, logits_rows)` must decode through a paged kernel
    whose launch depends only on tensor shapes (no host reads of the inputs)."""

    def __init__(self, model, kv_caches: list, max_num_seqs: int, max_blocks: int,
                 null_block: int, block_size: int, device: str) -> None:
        self.model, self.kv_caches = model, kv_caches
        self.buckets = graph_buckets(max_num_seqs)
        self.max_blocks = max_blocks
        self.null_block = null_block
        n, dev = self.buckets[-1], device
        self.ids = torch.zeros(n, dtype=torch.long, device=dev)
        self.positions = torch.zeros(n, dtype=torch.long, device=dev)
        self.slots = torch.full((n,), null_block * block_size, dtype=torch.long, device=dev)
        self.tables = torch.full((n, max_blocks), null_block, dtype=torch.long, device=dev)
        self.lens = torch.ones(n, dtype=torch.long, device=dev)
        self.rows = torch.arange(n, device=dev)
        self.graphs: dict[int, Callable[[], torch.Tensor]] = {}
        self.replays = 0  # steps run through a graph (a figure for tests and logs)

    def capture(self, backend: CaptureBackend) -> None:
        for b in reversed(self.buckets):
            self.graphs[b] = backend.capture(partial(self._forward, b))

    def _forward(self, b: int) -> torch.Tensor:
        meta = AttentionMetadata(self.slots[:b], [], 0, decode_block_tables=self.tables[:b],
                                 decode_lens=self.lens[:b])
        return self.model(self.ids[:b], self.positions[:b], self.kv_caches, meta,
                          self.rows[:b])

    def bucket(self, batch_size: int, width: int) -> int | None:
        """The bucket a decode step of this size and table width runs in; None: eager."""
        if not self.graphs or width > self.max_blocks:
            return None
        return next((b for b in self.buckets if b >= batch_size), None)

    def run(self, ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
            tables: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
        """Logits [bucket, vocab] of a step already padded to a bucket (padding rows: slot
        and table on the null block, length 1). The tensor is the graph's own: read it
        before the next replay."""
        b, w = tables.shape
        self.ids[:b].copy_(ids)
        self.positions[:b].copy_(positions)
        self.slots[:b].copy_(slots)
        self.tables[:b, :w].copy_(tables)  # columns past w: stale ids, never read (lens)
        self.lens[:b].copy_(lens)
        self.replays += 1
        return self.graphs[b]()
