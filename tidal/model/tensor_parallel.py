"""Tensor parallelism of the Llama-family layers, Megatron's split: each rank holds 1/N of
the attention heads (query and key/value alike) and of the MLP's intermediate rows. q/k/v
and gate/up are split by output rows (column-parallel, no communication); o and down by
input columns (row-parallel), and their partial outputs are summed over the ranks with one
all-reduce each. The embedding and the LM head are split by vocabulary rows: a rank looks
up the tokens it holds (zeros for the rest, then one all-reduce) and computes the logits of
its rows, which an all-gather joins. Norms stay whole, so every rank holds the same hidden
states after each all-reduce, the same logits after the gather, and samples the same
tokens: a rank's runner needs no word from the others beside the step's plan."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, replace
from functools import cached_property
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from tidal.model import shm_all_reduce
from tidal.model.config import TP_FLAG as FLAG
from tidal.model.config import ModelArch, kv_heads_held, part_arch, shard_arch, stage_arch
from tidal.model.hosts import interface_towards, machine_id
from tidal.model.mlp import SparseMoE
from tidal.model.pipeline_parallel import StageLinks
from tidal.model.shm_all_reduce import ShmAllReduce



class TPGroup:
    """This process's place in a tensor-parallel group, over torch.distributed (gloo: CPU
    tensors, over loopback or across machines), with the forward pass's all-reduces
    through shared memory where all its ranks share a machine (`shm`); `local`: the ranks
    on this machine. With pipeline stages the group is one stage's ranks, `links` this
    rank's StageLinks, and `tp` its torch.distributed subgroup (None: the whole world)."""

    def __init__(self, rank: int, size: int, shm: ShmAllReduce | None = None,
                 local: int | None = None, tp=None, links: StageLinks | None = None) -> None:
        self.rank, self.size, self.shm = rank, size, shm
        self.local = size if local is None else local
        self.tp, self.links = tp, links

    @classmethod
    def join(cls, rank: int, size: int, init_method: str, timeout_s: float,
             stages: int = 1) -> "TPGroup":
        """Join the `stages` x `size` ranks that meet at `init_method` (a file store none of
        them has used, `file://PATH`, where all share this machine; else rank 0's TCP
        store, `tcp://ADDR:PORT`) as global rank `rank` (stage rank // size); a collective
        that waits longer than `timeout_s` (a rank died or hangs) raises instead of
        hanging."""
        if init_method.startswith("tcp://"):
            # gloo's own pick is the address of the host's name, which may route nowhere
            # near the other machines: the interface that reaches rank 0's instead
            host = init_method.removeprefix("tcp://").rsplit(":", 1)[0]
            os.environ["GLOO_SOCKET_IFNAME"] = interface_towards(host)
        world = size * stages
        dist.init_process_group("gloo", init_method=init_method, rank=rank,
                                world_size=world, timeout=timedelta(seconds=timeout_s))
        machines = [None] * world
        dist.all_gather_object(machines, machine_id())
        stage, place = divmod(rank, size)
        tp, links = None, None
        if stages > 1:  # every rank makes every subgroup, in the same order
            rows = [dist.new_group(list(range(s * size, (s + 1) * size))) for s in range(stages)]
            columns = [dist.new_group(list(range(p, world, size))) for p in range(size)]
            column = machines[place::size]
            tp, links = rows[stage], StageLinks(rank, size, stages, columns[place],
                                                column.count(column[0]) == stages)
        mine = machines[stage * size:(stage + 1) * size]
        shm = None
        if mine.count(mine[0]) == size > 1 and shm_all_reduce.supported():
            shm = ShmAllReduce(place, size, timeout_s) if place == 0 else None
            name = [shm.name if shm else None]
            dist.broadcast_object_list(name, src=stage * size, group=tp)
            shm = shm or ShmAllReduce(place, size, timeout_s, name=name[0])
            dist.barrier(group=tp)  # every rank attached: its creator may unlink it at close
        return cls(place, size, shm, machines.count(machines[rank]), tp, links)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of `x` over the ranks (in float32 on the wire for other dtypes)."""
        if self.shm is not None:
            return self.shm.all_reduce(x)
        if x.dtype == torch.float32:
            dist.all_reduce(x, group=self.tp)
            return x
        wide = x.float()
        dist.all_reduce(wide, group=self.tp)
        return wide.to(x.dtype)

    def sum_in_place(self, x: torch.Tensor) -> None:
        """`x` := its sum over the ranks (the C++ decoder's sums where ranks span machines)."""
        total = self.all_reduce(x)
        if total is not x:
            x.copy_(total)

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's float32 [rows, columns] side by side, in rank order: [rows, size *
        columns] (the logits of each rank's vocabulary rows)."""
        x = x.float().contiguous()
        if self.shm is not None:
            return self.shm.all_gather(x)
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x, group=self.tp)
        return torch.cat(parts, dim=1)

    def min(self, value: int) -> int:
        """The least of an integer over every rank of every stage (the KV blocks all can
        hold)."""
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
    input features, the partial outputs summed over the group (bias on rank 0 only); or
    any module whose output is this rank's partial sum (a routed experts block)."""

    def __init__(self, linear: nn.Module, group: TPGroup) -> None:
        super().__init__()
        self.linear, self.group = linear, group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.all_reduce(self.linear(x))


class VocabParallelEmbedding(nn.Module):
    """This rank's rows of the embedding table, `start` its first token id: a token held
    elsewhere looks up zeros, and the all-reduce brings every token's row to every rank
    (exactly: one nonzero term each)."""

    def __init__(self, inner: nn.Module, start: int, group: TPGroup) -> None:
        super().__init__()
        self.inner, self.start, self.group = inner, start, group
        self.rows = inner.num_embeddings

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.rows)
        h = self.inner(local.masked_fill(outside, 0))
        return self.group.all_reduce(h.masked_fill(outside.unsqueeze(-1), 0))


class VocabParallelHead(nn.Module):
    """The LM head over this rank's vocabulary rows (`head` None: the tied embedding's
    rows): each rank's logits gathered into the whole vocabulary's, the padding rows of an
    uneven split cut off."""

    def __init__(self, head: nn.Module | None, embedding: nn.Module, vocab: int,
                 group: TPGroup) -> None:
        super().__init__()
        self.head, self.embedding, self.vocab, self.group = head, embedding, vocab, group

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        local = (self.head(h) if self.head is not None
                 else torch.nn.functional.linear(h, self.embedding.weight))
        return self.gather(local)

    def gather(self, local: torch.Tensor) -> torch.Tensor:
        """The whole vocabulary's logits from each rank's `local` [rows, vocab rows]."""
        return self.group.all_gather(local)[:, :self.vocab]


# Projections split by output rows (column-parallel): one part, or a fused checkpoint
# tensor's parts (Phi-3 stores q/k/v and gate/up fused), each split alike. w1/w3/w2 are
# Mixtral's expert gate/up/down.
_ROW_SPLIT = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "qkv_proj", "gate_up_proj",
              "w1", "w3")
_COLUMN_SPLIT = ("o_proj", "down_proj", "w2")  # by input columns (row-parallel), then summed
_EXPERT = re.compile(r"\.experts\.(\d+)\.")  # one routed expert's tensor
_LAYER = re.compile(r"(?<![^.])layers\.(\d+)\.")  # one decoder layer's
_VOCAB_SPLIT = ("embed_tokens", "lm_head")  # by vocabulary rows
# A LoRA adapter's (projection, part) -> the checkpoint module it adapts
_LORA_MODULES = {("qkv", 0): "q_proj", ("qkv", 1): "k_proj", ("qkv", 2): "v_proj",
                 ("o", 0): "o_proj", ("gate_up", 0): "gate_proj", ("gate_up", 1): "up_proj",
                 ("down", 0): "down_proj"}


@dataclass(frozen=True)
class Shard:
    """The part of each checkpoint tensor one rank keeps, cut as it is read, so a rank never
    holds the whole model: rows of q/k/v and gate/up, columns of o and down (their bias on
    rank 0 only), vocabulary rows of the embedding and the LM head, the rest whole. Routed
    experts split as a dense MLP does, or with `expert_parallel` each rank keeps 1/size of
    them whole. A pipeline stage's rank keeps only its `layers` (None: all), numbered from
    0. `arch`: the whole model's shapes."""

    rank: int
    size: int
    arch: ModelArch
    expert_parallel: bool = False
    layers: range | None = None

    @cached_property  # read for every tensor of a load
    def computed(self) -> ModelArch:
        """The shapes this rank computes with (shard_arch's, of its stage's layers)."""
        arch = shard_arch(self.arch, self.size, self.expert_parallel)
        return arch if self.layers is None else stage_arch(arch, self.layers)

    @cached_property
    def part(self) -> ModelArch:
        """The shapes of the model this rank builds: `computed`, with its vocabulary rows
        (part_arch's)."""
        return replace(self.computed, vocab_size=part_arch(self.arch, self.size).vocab_size)

    @property
    def first_expert(self) -> int:
        """The first routed expert this rank holds (its ids run on for the part's held)."""
        moe = self.part.moe
        return self.rank * moe.held if moe is not None and self.expert_parallel else 0

    def local_name(self, name: str) -> str | None:
        """Checkpoint tensor `name` with its layer's index made its stage's and a routed
        expert's id this rank's (under expert parallelism); None for a tensor of a layer
        or an expert another rank holds, which this rank never reads."""
        m = _LAYER.search(name)
        if m is not None and self.layers is not None:
            if int(m.group(1)) not in self.layers:
                return None
            name = f"{name[:m.start()]}layers.{int(m.group(1)) - self.layers.start}." \
                   f"{name[m.end():]}"
        m = _EXPERT.search(name)
        if m is None or not self.expert_parallel:
            return name
        local = int(m.group(1)) - self.first_expert
        if not 0 <= local < self.part.moe.held:
            return None
        return f"{name[:m.start()]}.experts.{local}.{name[m.end():]}"

    @property
    def vocab_rows(self) -> int:
        """Each rank's vocabulary rows (the last rank's padded with zero rows when the
        vocabulary does not divide)."""
        return self.part.vocab_size

    @property
    def vocab_start(self) -> int:
        return self.rank * self.vocab_rows

    def take(self, name: str, t, unit: int = 1):
        """This rank's part of checkpoint tensor `name` (a Hugging Face or tidal name; `t` a
        numpy array or torch tensor, [out, in] or [out]; a GGUF's quantized rows as bytes,
        `unit` bytes a block, which a split never cuts). ValueError naming the flag for a
        split that would cut a block."""
        module, kind = name.split(".")[-2:]
        if self.expert_parallel and _EXPERT.search(name):  # a held expert stays whole
            return t
        if module in _VOCAB_SPLIT:
            return self._vocab_rows(t)
        if module in _COLUMN_SPLIT:
            if kind == "bias":  # added once to the sum: by rank 0
                return t if self.rank == 0 else t * 0
            blocks = t.shape[1] // unit
            if blocks % self.size:
                raise ValueError(f"{FLAG} {self.size} would cut the blocks of {name} "
                                 f"({blocks} blocks a row)")
            step = t.shape[1] // self.size
            return t[:, self.rank * step:(self.rank + 1) * step]
        if module not in _ROW_SPLIT:
            return t
        a = self.arch
        kv = a.num_kv_heads * a.head_dim
        if module == "qkv_proj":
            parts = [(a.num_heads * a.head_dim, False), (kv, True), (kv, True)]
        elif module == "gate_up_proj":
            parts = [(t.shape[0] // 2, False)] * 2
        else:
            parts = [(t.shape[0], module in ("k_proj", "v_proj"))]
        pieces, at = [], 0
        for rows, kv_heads in parts:
            if kv_heads:  # its KV heads (one replicated on N/K ranks where K < N)
                first, count = kv_heads_held(self.rank, self.size, a.num_kv_heads)
                head = rows // a.num_kv_heads
                lo, hi = first * head, (first + count) * head
            else:
                step = rows // self.size
                lo, hi = self.rank * step, (self.rank + 1) * step
            pieces.append(t[at + lo:at + hi])
            at += rows
        if len(pieces) == 1:
            return pieces[0]
        return torch.cat(pieces) if isinstance(t, torch.Tensor) else np.concatenate(pieces)

    def _vocab_rows(self, t):
        piece = t[self.vocab_start:self.vocab_start + self.vocab_rows]
        short = self.vocab_rows - piece.shape[0]
        if not short:
            return piece
        # zero bytes are a zero row in every GGUF block format and float type alike
        if isinstance(t, torch.Tensor):
            return torch.cat([piece, piece.new_zeros((short, *piece.shape[1:]))])
        return np.concatenate([piece, np.zeros((short, *piece.shape[1:]), piece.dtype)])

    def take_lora(self, proj: str, part: int, a, b) -> tuple:
        """This rank's share of a LoRA adapter's piece (A [r, in], B [out, r]) for part `part`
        of projection `proj` (tidal.model.lora's names): B's rows where the projection's
        rows are split, A's columns where its columns are (the rank's delta then joins its
        partial sum before the all-reduce)."""
        name = _LORA_MODULES[proj, part] + ".weight"
        if proj in ("o", "down"):
            return self.take(name, a), b
        return a, self.take(name, b)

    def take_matrix(self, name: str, data: np.ndarray, shape: tuple[int, int],
                    unit: int) -> tuple[np.ndarray, tuple[int, int]]:
        """`take` of an [out, in] matrix stored as rows of `unit`-byte blocks (1: of
        values): this rank's copy, and its [out, in] shape."""
        cut = np.ascontiguousarray(self.take(name, data, unit))
        return cut, (cut.shape[0], shape[1] * cut.shape[1] // data.shape[1])


def split_model(model: nn.Module, group: TPGroup, shard: Shard) -> None:
    """Wrap the modules built of this rank's part so that they meet the other ranks': each
    layer's o and down projections (partial outputs summed), the embedding and the LM head
    (vocabulary rows); a routed experts block's output, a partial sum either way (each
    expert's share of its rows, or this rank's experts); and a pipeline stage's model
    meets its neighbours (`StageLinks`)."""
    model.stage = group.links
    if group.size == 1:  # a pipeline stage of one rank: nothing to sum
        return
    for layer in model.layers:
        layer.self_attn.o_proj = RowParallel(layer.self_attn.o_proj, group)
        if isinstance(layer.mlp, SparseMoE):
            layer.mlp.first_expert = shard.first_expert
            layer.mlp = RowParallel(layer.mlp, group)
        else:
            layer.mlp.down_proj = RowParallel(layer.mlp.down_proj, group)
    embedding = model.embed_tokens
    model.embed_tokens = VocabParallelEmbedding(embedding, shard.vocab_start, group)
    model.lm_head = VocabParallelHead(model.lm_head, embedding, shard.arch.vocab_size, group)
