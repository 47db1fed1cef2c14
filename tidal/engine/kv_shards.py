"""KV blocks between a split instance's ranks and the whole model's layout that P/D moves.

A rank of a tensor-parallel group holds its KV heads of its pipeline stage's layers. What
travels between instances is the blocks as one process holds them: every layer, every KV
head ([layers, 2 (K, V), blocks, block_size, kv heads, row width]), so a prefill instance
of any split sends to a decode instance of any other. Ranks are numbered stage by stage:
global rank = stage * tp + place in its stage's group.
"""

from __future__ import annotations

import torch

from tidal.model.config import kv_heads_held, stage_layers


class KVShards:
    """Where each rank's share of a block lies in the whole model's KV."""

    def __init__(self, tp: int, stages: int, num_layers: int, kv_heads: int) -> None:
        self.tp, self.stages = tp, stages
        self.num_layers, self.kv_heads = num_layers, kv_heads

    def heads_of(self, place: int) -> tuple[int, int]:
        """(first, count) of the KV heads the rank at `place` of its stage's group holds (a
        head replicated on several ranks where the model has fewer than the group)."""
        return kv_heads_held(place, self.tp, self.kv_heads)

    def layers_of(self, stage: int) -> range:
        return stage_layers(self.num_layers, self.stages, stage)

    def join(self, parts: list[torch.Tensor]) -> torch.Tensor:
        """Every rank's blocks (by global rank) as one process holds them: each stage's
        layers in turn, its ranks' heads side by side (a replicated head once)."""
        stages = []
        for stage in range(self.stages):
            heads: dict[int, torch.Tensor] = {}
            for place in range(self.tp):
                heads.setdefault(self.heads_of(place)[0], parts[stage * self.tp + place])
            stages.append(torch.cat([heads[first] for first in sorted(heads)], dim=4))
        return torch.cat(stages, dim=0)

    def split(self, kv: torch.Tensor) -> list[torch.Tensor]:
        """The whole model's blocks cut into each rank's share, by global rank."""
        parts = []
        for stage in range(self.stages):
            layers = self.layers_of(stage)
            mine = kv[layers.start:layers.stop]
            parts += [mine.narrow(4, *self.heads_of(place)).contiguous()
                      for place in range(self.tp)]
        return parts
