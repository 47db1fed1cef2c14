"""Tensor parallelism of the Llama-family layers, Megatron's split: each rank holds 1/N of
the attention heads (query and key/value alike) and of the MLP's intermediate rows. q/k/v
and gate/up are split by output rows (column-parallel, no communication); o and down by
input columns (row-parallel), and their partial outputs are summed over the ranks with one
all-reduce each. Norms, embeddings and the LM head stay whole on every rank, so every rank
holds the same hidden states after each all-reduce, computes the same logits and samples
the same tokens: a rank's runner needs no word from the others beside the step's plan."""

from __future__ import annotations

from dataclasses import replace
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from tidal.model import shm_all_reduce
from tidal.model.config import ModelArch
from tidal.model.shm_all_reduce import ShmAllReduce

FLAG = "--tensor-parallel-size"


class TPGroup:
    """This process's place in a tensor-parallel group, over torch.distributed's default
    process group (gloo: CPU tensors, over loopback or across machines), with the forward
    pass's all-reduces through shared memory where the ranks share a machine (`shm`)."""

    def __init__(self, rank: int, size: int, shm: ShmAllReduce | None = None) -> None:
        self.rank, self.size, self.shm = rank, size, shm

    @classmethod
    def join(cls, rank: int, size: int, store: str, timeout_s: float) -> "TPGroup":
        """Join the group of ranks on this machine that meet at the file `store` (a path
        none of them has used); a collective that waits longer than `timeout_s` (a rank died
        or hangs) raises instead of hanging."""
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                                world_size=size, timeout=timedelta(seconds=timeout_s))
        shm = None
        if size > 1 and shm_all_reduce.supported():
            shm = ShmAllReduce(rank, size, timeout_s) if rank == 0 else None
            name = [shm.name if shm else None]
            dist.broadcast_object_list(name, src=0)
            shm = shm or ShmAllReduce(rank, size, timeout_s, name=name[0])
            dist.barrier()  # every rank attached: rank 0 may unlink it at close
        return cls(rank, size, shm)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of `x` over the ranks (in float32 on the wire for other dtypes)."""
        if self.shm is not None:
            return self.shm.all_reduce(x)
        if x.dtype == torch.float32:
            dist.all_reduce(x)
            return x
        wide = x.float()
        dist.all_reduce(wide)
        return wide.to(x.dtype)

    def min(self, value: int) -> int:
        """The least of an integer over the ranks (the KV blocks every rank can hold)."""
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t.item())

    def close(self) -> None:
        if self.shm is not None:
            self.shm.close()
            self.shm = None
        if dist.is_initialized():
            dist.destroy_process_group()


class RowParallel(nn.Module):
    """A row-parallel projection: this rank's columns of the weight over its share of the
    input features, the partial outputs summed over the group (bias on rank 0 only)."""

    def __init__(self, linear: nn.Module, group: TPGroup) -> None:
        super().__init__()
        self.linear, self.group = linear, group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.all_reduce(self.linear(x))


def check_shardable(arch: ModelArch, size: int) -> None:
    """ValueError naming the flag where `arch` does not split over `size` ranks."""
    if size == 1:
        return
    if arch.moe is not None:
        raise ValueError(f"{FLAG} {size}: mixture-of-experts models do not split across "
                         f"ranks yet")
    for what, count in (("attention heads", arch.num_heads),
                        ("key/value heads", arch.num_kv_heads),
                        ("MLP intermediate size", arch.intermediate_size)):
        if count % size:
            raise ValueError(f"{FLAG} {size} does not divide the model's {count} {what}")


def shard_arch(arch: ModelArch, size: int) -> ModelArch:
    """The shapes one rank of `size` computes with: its heads and intermediate rows."""
    return replace(arch, num_heads=arch.num_heads // size,
                   num_kv_heads=arch.num_kv_heads // size,
                   intermediate_size=arch.intermediate_size // size)


def shard_model(model: nn.Module, arch: ModelArch, group: TPGroup) -> None:
    """Keep this rank's share of a model loaded whole (`arch`: its whole shapes), in place:
    the rest of each split weight is freed."""
    r, n = group.rank, group.size
    h, hkv, d = arch.num_heads, arch.num_kv_heads, arch.head_dim
    for layer in model.layers:
        attn = layer.self_attn
        parts = (h * d, hkv * d, hkv * d)  # q, k, v rows of the fused projection
        attn.qkv_proj = _linear(*(None if t is None else torch.cat(
            [p.chunk(n)[r] for p in t.split(parts)]) for t in _params(attn.qkv_proj)))
        attn.h, attn.hkv = h // n, hkv // n
        attn.o_proj = _row_parallel(attn.o_proj, group)
        mlp = layer.mlp
        mlp.gate_up_proj = _linear(*(None if t is None else torch.cat(
            [p.chunk(n)[r] for p in t.chunk(2)]) for t in _params(mlp.gate_up_proj)))
        mlp.down_proj = _row_parallel(mlp.down_proj, group)


def _params(linear: nn.Linear) -> tuple[torch.Tensor, torch.Tensor | None]:
    return linear.weight.data, None if linear.bias is None else linear.bias.data


def _row_parallel(linear: nn.Linear, group: TPGroup) -> RowParallel:
    weight, bias = _params(linear)
    return RowParallel(_linear(weight.chunk(group.size, dim=1)[group.rank],
                               bias if group.rank == 0 else None), group)


def _linear(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
    """An nn.Linear holding copies of these (so the whole tensors they were cut from go)."""
    with torch.device("meta"):
        layer = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None)
    layer.weight = nn.Parameter(weight.contiguous().clone(), requires_grad=False)
    if bias is not None:
        layer.bias = nn.Parameter(bias.contiguous().clone(), requires_grad=False)
    return layer
