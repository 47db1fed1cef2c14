"""Batched LoRA: a fixed pool of adapter slots, and projections that add each row's adapter
delta in one step that mixes adapters and the base model.

A step's rows that carry an adapter are sorted by slot (`LoRABatch`); each projection then
computes its delta as two grouped products over those segments, shrink (x A^T, rank R) then
expand (u B^T), as S-LoRA / Punica's segmented kernels do, and adds it to the base output
at those rows. On CPU with tidal's extension the products are its grouped expert kernel
(`grouped_linear`, the weights as 16-column panels), the same calls the C++ decoder makes,
so both paths give the same bits; elsewhere a loop over the step's slots multiplies.
The pool's weights are in the model's dtype, zero-padded to the largest rank.
"""

from __future__ import annotations

import torch
from torch import nn

from tidal.model.lora import PROJECTIONS, LoRAAdapter, projection_shapes
from tidal.model.mlp import PANEL, _each_expert, pack_panels


class LoRABatch:
    """The current forward pass's adapter rows: `rows` (sorted by slot) and `ends` (the
    cumulative row count of each slot), or None when no row carries an adapter."""

    __slots__ = ("rows", "ends")

    def __init__(self) -> None:
        self.rows: torch.Tensor | None = None
        self.ends: torch.Tensor | None = None

    def set(self, row_slots: list[int], num_slots: int, device) -> None:
        """`row_slots`: each row's slot, -1 for the base model."""
        pairs = sorted((s, i) for i, s in enumerate(row_slots) if s >= 0)
        if not pairs:
            self.rows = self.ends = None
            return
        counts = [0] * num_slots
        for s, _ in pairs:
            counts[s] += 1
        ends, total = [], 0
        for c in counts:
            total += c
            ends.append(total)
        self.rows = torch.tensor([i for _, i in pairs], dtype=torch.long, device=device)
        self.ends = torch.tensor(ends, dtype=torch.long, device=device)

    def clear(self) -> None:
        self.rows = self.ends = None


def _round16(n: int) -> int:
    return -(-n // PANEL) * PANEL


class SlotWeights:
    """One projection's slots: shrink [S, in, R] and expand [S, R, out] as x @ W takes them
    (16-column panels with the grouped kernel)."""

    def __init__(self, slots: int, k: int, rank: int, out: int, dtype, device, panels: bool):
        self.k, self.rank, self.out = k, _round16(rank), out
        self.out_padded = _round16(out) if panels else out
        self.panels = panels
        shapes = ([(slots, self.rank // PANEL, k, PANEL), (slots, self.out_padded // PANEL,
                                                           self.rank, PANEL)] if panels
                  else [(slots, k, self.rank), (slots, self.rank, out)])
        self.shrink = torch.zeros(shapes[0], dtype=dtype, device=device)
        self.expand = torch.zeros(shapes[1], dtype=dtype, device=device)

    def write(self, slot: int, a: torch.Tensor | None, b: torch.Tensor | None) -> None:
        """Slot `slot` := this adapter's A [r, in] and B [out, r] (None: no delta)."""
        shrink = torch.zeros(1, self.k, self.rank)
        expand = torch.zeros(1, self.rank, self.out_padded)
        if a is not None:
            r = a.shape[0]
            shrink[0, :, :r] = a.t()
            expand[0, :r, :self.out] = b.t()
        if self.panels:
            shrink, expand = pack_panels(shrink), pack_panels(expand)
        self.shrink[slot].copy_(shrink[0])
        self.expand[slot].copy_(expand[0])

    def delta(self, x: torch.Tensor, batch: LoRABatch, grouped) -> torch.Tensor:
        """The adapter rows' deltas, float32 [len(batch.rows), out]."""
        xs = x.index_select(0, batch.rows).float()
        if grouped is not None:
            u = grouped(xs, batch.ends, self.shrink)
            return grouped(u, batch.ends, self.expand)[:, :self.out]
        return _each_expert(xs, batch.ends, lambda part, s: (part @ self.shrink[s].float())
                            @ self.expand[s].float())


class LoRAProjection(nn.Module):
    """A projection plus its slots' deltas at the pass's adapter rows."""

    def __init__(self, base: nn.Module, weights: SlotWeights, batch: LoRABatch, grouped):
        super().__init__()
        self.base, self.weights, self.batch, self.grouped = base, weights, batch, grouped

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        if self.batch.rows is None:
            return y
        d = self.weights.delta(x.reshape(-1, x.shape[-1]), self.batch, self.grouped)
        return y.index_add_(0, self.batch.rows, d.to(y.dtype))


class SlotPool:
    """`num_slots` adapters' weights, resident for steps, wrapped around `model`'s
    projections; `decoder` (the C++ one, if any) reads the same tensors."""

    def __init__(self, model: nn.Module, arch, num_slots: int, max_rank: int, dtype, device,
                 ext=None, decoder=None) -> None:
        self.num_slots = num_slots
        self.batch = LoRABatch()
        grouped = ext.grouped_linear if ext is not None else None
        shapes = projection_shapes(arch)
        parts = {"qkv": 3, "o": 1, "gate_up": 2, "down": 1}  # pieces fused into each
        self.layers: list[dict[str, SlotWeights]] = []
        for i, layer in enumerate(model.layers):
            a, m = layer.self_attn, layer.mlp
            owners = {"qkv": (a, "qkv_proj"), "o": (a, "o_proj"), "gate_up": (m, "gate_up_proj"),
                      "down": (m, "down_proj")}
            weights = {}
            for proj in PROJECTIONS:
                k, outs = shapes[proj]
                w = SlotWeights(num_slots, k, parts[proj] * max_rank, sum(outs), dtype, device,
                                grouped is not None)
                owner, attr = owners[proj]
                setattr(owner, attr, LoRAProjection(getattr(owner, attr), w, self.batch, grouped))
                weights[proj] = w
            self.layers.append(weights)
            if decoder is not None:
                decoder.set_lora(i, [t for p in PROJECTIONS
                                     for t in (weights[p].shrink, weights[p].expand)])
        self.names: list[str | None] = [None] * num_slots  # the adapter in each slot

    def write(self, slot: int, adapter: LoRAAdapter) -> None:
        """Put `adapter` in `slot` (every projection it does not adapt gets no delta)."""
        for i, weights in enumerate(self.layers):
            for proj, w in weights.items():
                a, b = adapter.weights.get((i, proj), (None, None))
                w.write(slot, a, b)
        self.names[slot] = adapter.name

    @property
    def nbytes(self) -> int:
        return sum(w.shrink.nbytes + w.expand.nbytes for ws in self.layers for w in ws.values())
