"""The feed-forward blocks: a gated MLP, and routed experts (mixture of experts).

`SparseMoE` runs experts grouped, not token by token: each token's top-k (token, expert)
pairs are sorted by expert, and every expert that received tokens runs its gated MLP once
over all of them (two matmuls); the weighted outputs are added back into their rows. The
Python loop is over experts (a layer's E iterations at most), never over tokens; the
experts are ordinary linear layers, so the CPU runner's packed bf16 and int8/int4 layers
apply to them as to a dense MLP. The block takes hidden rows and returns hidden rows, so
an expert-parallel split would replace only its loop.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tidal.model.config import ModelArch


def activation(name: str):
    """transformers' ACT2FN entries that gated MLPs use."""
    return {"silu": F.silu, "gelu": F.gelu,
            "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}[name]


class MLP(nn.Module):
    """act(x W_gate) * (x W_up), then W_down; gate and up are one fused matmul."""

    def __init__(self, hidden: int, intermediate: int, act: str, bias: bool = False) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden, 2 * intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)
        self.act = activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(self.act(gate) * up)


class SparseMoE(nn.Module):
    """Routed experts: the router's softmax picks each token's top-k experts, whose outputs
    are summed with those probabilities (renormalised over the k when the model says so);
    Qwen2-MoE adds a shared expert scaled by sigmoid(x W_shared_gate)."""

    def __init__(self, arch: ModelArch) -> None:
        super().__init__()
        spec = arch.moe
        self.top_k, self.renormalize = spec.top_k, spec.renormalize
        self.gate = nn.Linear(arch.hidden_size, spec.num_experts, bias=False)  # the router
        self.experts = nn.ModuleList(
            MLP(arch.hidden_size, spec.intermediate_size, arch.hidden_act)
            for _ in range(spec.num_experts))
        self.shared_expert = self.shared_expert_gate = None
        if spec.shared_intermediate_size:
            self.shared_expert = MLP(arch.hidden_size, spec.shared_intermediate_size,
                                     arch.hidden_act)
            self.shared_expert_gate = nn.Linear(arch.hidden_size, 1, bias=False)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k] in x's dtype, experts [T, k]) of each token."""
        probs = torch.softmax(self.gate(x).float(), dim=-1)
        weights, experts = probs.topk(self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, experts = self.route(x)
        flat = experts.flatten()
        order = flat.argsort(stable=True)  # the (token, expert) pairs grouped by expert
        counts = torch.bincount(flat, minlength=len(self.experts)).tolist()  # one sync
        rows = order // self.top_k
        xs, ys = x[rows], torch.empty_like(x[rows])  # inputs and outputs in expert order
        start = 0
        for expert, n in zip(self.experts, counts):
            if n:  # views in, one copy out: the loop adds no gather or scatter of its own
                ys[start:start + n] = expert(xs[start:start + n])
            start += n
        ys *= weights.flatten()[order, None]
        out = torch.zeros_like(x).index_add_(0, rows, ys)
        if self.shared_expert is not None:
            out += torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out
