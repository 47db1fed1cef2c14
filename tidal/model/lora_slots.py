"""Batched LoRA: a fixed pool of adapter slots, and projections that add each row's adapter
delta in one step that mixes adapters and the base model.

A step's rows that carry an adapter are sorted by slot (`LoRABatch`); each projection then
adds each row's delta, shrink (u = x A^T, rank R) then expand (u B^T), over those segments,
as S-LoRA's and Punica's segmented kernels do. On CPU with tidal's extension both products
are one call (`lora_add`, csrc/lora.cpp), the one the C++ decoder makes, so both paths give
the same bits; on CUDA the Triton kernel of the same arguments (kernels/lora.py); without
either, a pair of matmuls per slot of the step.
The pool's weights are in the model's dtype or lora_dtype's (bfloat16 under float32 rows
halves the bytes a step streams per adapter), each part of a fused projection (q, k, v;
gate, up) in its own max_lora_rank ranks, zero past an adapter's rank: B is block-diagonal,
and the kernel multiplies an output column by its part's ranks alone.
"""

from __future__ import annotations

from itertools import accumulate

import torch
from torch import nn

from tidal.model.lora import PROJECTIONS, LoRAAdapter, projection_shapes
from tidal.model.mlp import _each_expert
from tidal.model.tensor_parallel import RowParallel


class LoRABatch:
    """The current forward pass's adapter rows: `rows` (sorted by slot) and `ends` (the
    cumulative row count of each slot), or None when no row carries an adapter."""

    __slots__ = ("rows", "ends")

    def __init__(self) -> None:
        self.rows: torch.Tensor | None = None
        self.ends: torch.Tensor | None = None

    def set(self, row_slots: list[int], num_slots: int, device) -> None:
        """`row_slots`: each row's slot, -1 for the base model."""
        by_slot: list[list[int]] = [[] for _ in range(num_slots)]  # grouped, no sort
        for i, s in enumerate(row_slots):
            if s >= 0:
                by_slot[s].append(i)
        if not any(by_slot):
            self.rows = self.ends = None
            return
        self.rows = torch.tensor([i for rows in by_slot for i in rows], dtype=torch.long,
                                 device=device)
        self.ends = torch.tensor(list(accumulate(map(len, by_slot))), dtype=torch.long,
                                 device=device)

    def clear(self) -> None:
        self.rows = self.ends = None


class SlotWeights:
    """One projection's slots: A [S, R, k] and B transposed, [S, R, n] (both contiguous
    along what a product runs over), zero past each adapter's rank."""

    def __init__(self, slots: int, k: int, max_rank: int, outs: list[int], dtype,
                 device) -> None:
        self.max_rank, self.outs = max_rank, outs
        rank = max_rank * len(outs)  # part p's ranks: [p max_rank, (p + 1) max_rank)
        self.a = torch.zeros(slots, rank, k, dtype=dtype, device=device)
        self.b = torch.zeros(slots, rank, sum(outs), dtype=dtype, device=device)
        # the fused parts' cumulative outputs: part p's columns use its ranks alone
        self.bounds = torch.tensor(outs, device=device).cumsum(0)

    def write(self, slot: int, pieces: list[tuple[int, torch.Tensor, torch.Tensor]]) -> None:
        """Slot `slot` := an adapter's pieces of this projection, (part, A [r, in], B [part's
        out, r]) each (none: no delta)."""
        self.a[slot].zero_()
        self.b[slot].zero_()
        for part, a, b in pieces:
            r0, c0, r = part * self.max_rank, sum(self.outs[:part]), a.shape[0]
            self.a[slot, r0:r0 + r].copy_(a)
            self.b[slot, r0:r0 + r, c0:c0 + b.shape[0]].copy_(b.t())

    def add(self, x: torch.Tensor, y: torch.Tensor, batch: LoRABatch, kernel) -> torch.Tensor:
        """y with the adapter rows' deltas added: `kernel` (the extension's lora_add, in
        place) or a product per slot."""
        if kernel is not None and x.is_contiguous() and y.is_contiguous():
            kernel(x, y, self.a, self.b, batch.rows, batch.ends, self.bounds)
            return y
        xs = x.index_select(0, batch.rows).float()
        d = _each_expert(xs, batch.ends, lambda part, s: (part @ self.a[s].t().float())
                         @ self.b[s].float())
        return y.index_add_(0, batch.rows, d.to(y.dtype))


class LoRAProjection(nn.Module):
    """A projection plus its slots' deltas at the pass's adapter rows."""

    def __init__(self, base: nn.Module, weights: SlotWeights, batch: LoRABatch, kernel):
        super().__init__()
        self.base, self.weights, self.batch, self.kernel = base, weights, batch, kernel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        if self.batch.rows is None:
            return y
        return self.weights.add(x, y, self.batch, self.kernel)


class SlotPool:
    """`num_slots` adapters' weights, resident for steps, wrapped around `model`'s
    projections; `decoder` (the C++ one, if any) reads the same tensors."""

    def __init__(self, model: nn.Module, arch, num_slots: int, max_rank: int, dtype, device,
                 kernel=None, decoder=None) -> None:
        """`kernel`: lora_add, the C++ extension's (CPU) or Triton's (CUDA); None: matmuls."""
        self.num_slots = num_slots
        self.batch = LoRABatch()
        shapes = projection_shapes(arch)
        self.layers: list[dict[str, SlotWeights]] = []
        for i, layer in enumerate(model.layers):
            a, m = layer.self_attn, layer.mlp
            owners = {"qkv": (a, "qkv_proj"), "o": (a, "o_proj"), "gate_up": (m, "gate_up_proj"),
                      "down": (m, "down_proj")}
            weights = {}
            for proj in PROJECTIONS:
                owner, attr = owners[proj]
                if not hasattr(owner, attr):
                    continue  # a layer of routed experts: adapters touch its attention only
                k, outs = shapes[proj]
                w = SlotWeights(num_slots, k, max_rank, outs, dtype, device)
                base = getattr(owner, attr)
                if isinstance(base, RowParallel):  # a rank's delta joins its partial sum
                    owner, attr = base, "linear"
                setattr(owner, attr, LoRAProjection(getattr(owner, attr), w, self.batch, kernel))
                weights[proj] = w
            self.layers.append(weights)
            if decoder is not None:
                decoder.set_lora(i, [t for p in PROJECTIONS
                                     for t in (weights[p].a, weights[p].b, weights[p].bounds)])
        self.names: list[str | None] = [None] * num_slots  # the adapter in each slot

    def write(self, slot: int, adapter: LoRAAdapter) -> None:
        """Put `adapter` in `slot` (every projection it does not adapt gets no delta)."""
        for i, weights in enumerate(self.layers):
            for proj, w in weights.items():
                w.write(slot, adapter.weights.get((i, proj), []))
        self.names[slot] = adapter.name

    @property
    def nbytes(self) -> int:
        return sum(w.a.nbytes + w.b.nbytes for ws in self.layers for w in ws.values())
