"""The feed-forward blocks: a gated MLP, and routed experts (mixture of experts).

`SparseMoE` runs experts grouped, not token by token: each token's top-k (token, expert)
pairs are sorted by expert, and every expert that received tokens runs its gated MLP once
over all of them (two matmuls); the weighted outputs are added back into their rows. As
loaded, the experts are ordinary linear layers looped over in Python (a layer's E
iterations at most, never one per token), so the CPU runner's int8/int4 layers apply to
them as to a dense MLP. `group_experts()` stacks their weights instead (the CPU runner's
choice for unquantized models): each projection of every expert is then one call, either
`torch._grouped_mm` or, with tidal's C++ extension, its `grouped_linear` over weights kept
as 16-column panels at decode sizes (a step of 32 tokens over 8 experts gives each ~8 rows,
where a GEMM call per expert costs more in fixed overhead than in arithmetic) and BLAS per
expert at prefill sizes. Under expert parallelism a block holds a contiguous run of the
experts (`first_expert` on) and runs only the (token, expert) pairs routed to them; its
output is then that rank's partial sum.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tidal.model.config import ModelArch
from tidal.model.linear import products


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
        self.silu = act == "silu"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(self.act(gate) * up)

    def fused(self, x: torch.Tensor, silu_mul) -> torch.Tensor:
        """forward with SiLU(gate) * up as one kernel (`silu_mul(gate_up, dtype)`) for the
        fused ops, which read the projections' products as they leave them: a GGUF
        projection's bf16 tiles' products stay bf16 (no float32 copy of them is written and
        read back), gate/up's and, for the next fused norm, down's."""
        y = products(self.gate_up_proj, x)
        act = silu_mul(y.view(-1, y.shape[-1]), x.dtype).view(*x.shape[:-1], -1)
        return products(self.down_proj, act)


class SparseMoE(nn.Module):
    """Routed experts: the router's softmax picks each token's top-k experts, whose outputs
    are summed with those probabilities (renormalised over the k when the model says so);
    Qwen2-MoE adds a shared expert scaled by sigmoid(x W_shared_gate). The block holds
    `spec.held` of the experts, from `first_expert` (all of them, but under expert
    parallelism)."""

    def __init__(self, arch: ModelArch) -> None:
        super().__init__()
        spec = arch.moe
        self.top_k, self.renormalize = spec.top_k, spec.renormalize
        self.gate = nn.Linear(arch.hidden_size, spec.num_experts, bias=False)  # the router
        self.experts = nn.ModuleList(
            MLP(arch.hidden_size, spec.intermediate_size, arch.hidden_act)
            for _ in range(spec.held))
        self.num_experts, self.routed = spec.held, spec.num_experts
        self.first_expert = 0
        self.w_gate_up = self.w_down = None  # [E, hidden, 2 I] and [E, I, hidden], once grouped
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

    def group_experts(self, dtype: torch.dtype = torch.float32, kernel=None) -> None:
        """Stack the experts' weights (in `dtype`) for grouped matmuls, dropping the
        per-expert layers; the block computes the same function. `kernel(xs, ends, w)`, if
        given (tidal's C++ `grouped_linear` on CPU), runs them instead of torch's grouped
        matmul, over weights stored as 16-column panels (`pack_panels`; float32 or bf16,
        which it widens as it reads), computing in float32."""
        experts = list(self.experts)
        gate_up = torch.stack([e.gate_up_proj.weight.detach().t() for e in experts]).to(dtype)
        down = torch.stack([e.down_proj.weight.detach().t() for e in experts]).to(dtype)
        if kernel is not None and gate_up.shape[2] % PANEL == 0 and down.shape[2] % PANEL == 0:
            gate_up, down = pack_panels(gate_up), pack_panels(down)
        else:
            kernel = None
        self.w_gate_up = nn.Parameter(gate_up.contiguous(), requires_grad=False)
        self.w_down = nn.Parameter(down.contiguous(), requires_grad=False)
        self.act, self.kernel = experts[0].act, kernel
        self.compute_dtype = torch.float32 if kernel is not None else dtype
        self.experts = nn.ModuleList()  # the stacked copies replace them

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, experts = self.route(x)
        flat, weights = experts.flatten() - self.first_expert, weights.flatten()
        rows = None  # each pair's token: pair // top_k, where the block holds every expert
        if self.num_experts < self.routed:  # expert parallel: the pairs of the held experts
            held = ((flat >= 0) & (flat < self.num_experts)).nonzero().squeeze(1)
            flat, weights, rows = flat[held], weights[held], held // self.top_k
        dtype = x.dtype if self.w_gate_up is None else self.compute_dtype
        out = torch.zeros_like(x, dtype=dtype)
        if flat.numel():
            order = flat.argsort(stable=True)  # the (token, expert) pairs grouped by expert
            # scatter_add, not bincount: CUDA's bincount reads the largest id on the host
            counts = flat.new_zeros(self.num_experts).scatter_add_(0, flat,
                                                                   torch.ones_like(flat))
            ends = counts.cumsum(0).to(torch.int32)
            rows = order // self.top_k if rows is None else rows[order]
            xs = x[rows]  # inputs in expert order
            if self.w_gate_up is not None:  # in the compute dtype until the sum
                ys = self._grouped(xs.to(self.compute_dtype), ends)
            else:
                ys = _each_expert(xs, ends, lambda part, e: self.experts[e](part))
            ys *= weights[order, None]
            out.index_add_(0, rows, ys)
        if self.shared_expert is not None:
            out += torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out.to(x.dtype)

    def _grouped(self, xs: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
        """Every expert's gated MLP over its rows of `xs` (grouped by expert), two calls."""
        h = self._matmul(xs, ends, self.w_gate_up)
        gate, up = h.chunk(2, dim=-1)
        return self._matmul(self.act(gate) * up, ends, self.w_down)

    def _matmul(self, xs: torch.Tensor, ends: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        if self.kernel is None:
            return _grouped_mm(xs, ends, w)
        if xs.shape[0] <= 16 * self.num_experts:  # decode sizes: the kernel's, one call
            return self.kernel(xs, ends, w)
        # prefill sizes: BLAS per expert over the panels (measured: within 1.4x of torch's
        # grouped matmul on unpacked weights at 2,048 rows, where the kernel takes 2.2x)
        return _each_expert(xs, ends, lambda part, e: torch.matmul(part, w[e].to(xs.dtype))
                            .permute(1, 0, 2).reshape(len(part), -1))


PANEL = 16  # output columns of a panel in tidal's grouped kernel's weight layout


def pack_panels(w: torch.Tensor) -> torch.Tensor:
    """[E, k, n] -> [E, n/16, k, 16]: each 16-column panel of an expert's weight in one
    contiguous block, what one task of the grouped kernel reads."""
    e, k, n = w.shape
    return w.view(e, k, n // PANEL, PANEL).permute(0, 2, 1, 3).contiguous()


def _grouped_mm(xs: torch.Tensor, ends: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Per expert e, its rows of xs @ w[e] (torch's grouped matmul, which needs 16-byte
    strides; other widths loop over the experts)."""
    if xs.shape[1] % 4 or w.shape[2] % 4:
        return _each_expert(xs, ends, lambda part, e: part @ w[e])
    return torch._grouped_mm(xs, w, offs=ends)


def _each_expert(xs: torch.Tensor, ends: torch.Tensor, run) -> torch.Tensor:
    """run(rows, e) for each expert e that has rows of `xs` (grouped by expert, cumulative
    `ends`), concatenated: a Python loop over busy experts, after one host sync."""
    starts = [0, *ends.tolist()]
    return torch.cat([run(xs[a:b], e) for e, (a, b) in enumerate(zip(starts, starts[1:]))
                      if b > a])


def group_experts(model: nn.Module, dtype: torch.dtype = torch.float32, kernel=None) -> None:
    """Every SparseMoE block of `model` runs its experts as grouped matmuls in `dtype`
    (SparseMoE.group_experts)."""
    for module in model.modules():
        if isinstance(module, SparseMoE) and module.w_gate_up is None:
            module.group_experts(dtype, kernel)
