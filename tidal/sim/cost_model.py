"""The simulator's executor: how long one scheduled step takes, by a roofline.

For a step's scheduled requests (each `n` new tokens after `c` cached ones):
  linear    = max(2 * P * tokens + 2 * V * H * sampled rows   over  peak * compute_eff,
                  (+ the busiest rank's expert picks above the average's, experts split whole)
                  weight bytes                                 over  bandwidth * bw_eff)
  attention = max(4 * L * Hq * D * sum(n*c + n(n+1)/2)         over  peak * attention_eff,
                  KV bytes read and written                    over  bandwidth * bw_eff)
  step      = linear + attention + step_overhead + seq_overhead * seqs + token_overhead * tokens
              + context_overhead * cached tokens gathered (sequences with c > 0 read c + n)
              + (2 * L + 1) * (all_reduce_latency + tokens * H * dtype bytes / all_reduce_bandwidth)
              + all_reduce_latency + sampled rows * V * 4 bytes / all_reduce_bandwidth
                                                  with tensor parallelism (tp > 1)
              + (pp - 1) * (all_reduce_latency + tokens * H * 4 bytes / all_reduce_bandwidth)
              + all_reduce_latency + sampled rows * H * 4 bytes / all_reduce_bandwidth
                                                  with pipeline stages (pp > 1)
Under tensor parallelism every term is one rank's: its heads, MLP rows and vocabulary rows
(`arch` is the rank's shapes), as tidal splits a model; the group sums each layer's two
partial outputs and the embedding's, and gathers the sampled rows' logits. With pipeline
stages a step's time is every layer's as on one rank (each stage's memory holds only its
layers, `kv_blocks_for` a stage's shapes), plus the hidden states sent from stage to stage
and the last stage's final states sent back to all (over the same links as the
all-reduces); the replica (tidal/sim/replica.py) spreads it over the stages in equal shares
and overlaps the steps in flight.
or, for a profile holding a server's learned model (`step_time`), what that model predicts
plus step_overhead.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from typing import Callable

from tidal.core.step_time import ERROR_QUANTILES, LinearStepTime, StepShape
from tidal.model.config import ModelArch
from tidal.sim.profiles import (Hardware, expert_params, kv_token_bytes, linear_params,
                                picked_expert_params)


__all__ = ["CostModel", "StepShape"]


class CostModel:
    """Step times of a model on a piece of hardware (a `tidal.core.StepTimeModel`); with
    `tp` > 1, of one of its tensor-parallel ranks (`arch`: the rank's shapes, part_arch's)
    and the group's all-reduces and logits gather; with `pp` > 1, of its stages in turn."""

    def __init__(self, arch: ModelArch, hw: Hardware, tp: int = 1, pp: int = 1,
                 kv_cache_dtype: str = "auto") -> None:
        self.arch, self.hw, self.stages = arch, hw, pp
        # two all-reduces a layer and the embedding's, each a call and the step's hidden
        # states; one gather of the sampled rows' float32 logits
        self.all_reduces = 2 * arch.num_layers + 1 if tp > 1 else 0
        self.reduce_bytes_per_token = arch.hidden_size * hw.dtype_bytes
        self.gather_bytes_per_row = 4 * tp * arch.vocab_size
        dtype_bytes = hw.dtype_bytes
        per_weight = hw.weight_bytes or dtype_bytes
        self.linear_flops_per_token = 2 * linear_params(arch)
        self.head_flops_per_row = 2 * arch.vocab_size * arch.hidden_size
        embed = arch.vocab_size * arch.hidden_size
        # Routed experts are read only when some token of the step picks them.
        self.expert_bytes = expert_params(arch) * per_weight
        active = arch.moe.top_k * self.expert_bytes // arch.moe.num_experts if arch.moe else 0
        self.weight_bytes = (linear_params(arch) + embed) * per_weight - active
        self.idle_odds = 1 - arch.moe.top_k / arch.moe.num_experts if arch.moe else 0.0
        # Experts split whole (expert parallelism): a step waits for the rank whose experts
        # its tokens picked most; rows split (or one rank) share every pick evenly.
        self.expert_ranks = arch.moe.num_experts // arch.moe.held if arch.moe else 1
        self.picked_flops_per_token = 2 * picked_expert_params(arch)
        self.attn_flops_per_pair = 4 * arch.num_layers * arch.num_heads * arch.head_dim
        self.kv_bytes_per_token = kv_token_bytes(arch, hw, kv_cache_dtype)
        # A server's own learned model, where the profile carries one (`tidal calibrate
        # --learned-from`): steps take what it predicts, plus the serving overhead.
        self.learned = LinearStepTime(hw.step_time) if hw.step_time else None
        if hw.step_scatter is not None and len(hw.step_scatter) != len(ERROR_QUANTILES):
            raise ValueError(f"step_scatter holds {len(ERROR_QUANTILES)} values (measured / "
                             f"predicted at quantiles {ERROR_QUANTILES}), got "
                             f"{len(hw.step_scatter)}")

    def roofline(self, shape: StepShape) -> float:
        hw = self.hw
        flops = self.linear_flops_per_token * shape.tokens + self.head_flops_per_row * shape.sampled
        if self.expert_ranks > 1:  # the busiest rank's picks above the average rank's
            flops += (self.picked_flops_per_token * shape.tokens
                      * (self.expert_imbalance(shape.tokens) - 1))
        bandwidth = hw.mem_bandwidth * hw.bandwidth_efficiency
        compute = flops / (hw.peak_flops * hw.compute_efficiency)
        weight_bytes = self.weight_bytes
        if self.expert_bytes:  # the expected share of experts that T tokens' picks touch
            weight_bytes += self.expert_bytes * (1 - self.idle_odds ** shape.tokens)
        memory = weight_bytes / bandwidth
        linear = compute if compute > memory else memory  # max(), without a call: every step
        compute = self.attn_flops_per_pair * shape.pairs / (hw.peak_flops * hw.attention_efficiency)
        memory = self.kv_bytes_per_token * shape.kv_tokens / bandwidth
        return linear + (compute if compute > memory else memory)

    def expert_imbalance(self, tokens: int) -> float:
        """The expected most picks on one rank over the average rank's, for a step of
        `tokens` whose top-k picks land on the experts uniformly at random (m picks on N
        ranks: mean m/N, deviation sqrt(m (1/N)(1 - 1/N)), the largest of N about
        sqrt(2 ln N) deviations above the mean, at most all of them on one rank)."""
        n = self.expert_ranks
        if n == 1 or tokens == 0:
            return 1.0
        picks = tokens * self.arch.moe.top_k
        return min(n, 1 + math.sqrt(2 * math.log(n) * (n - 1) / picks))

    def shape_time(self, shape: StepShape) -> float:
        hw = self.hw
        if shape.seqs == 0:
            return 0.0
        if self.learned is not None:
            return self.learned.shape_time(shape) + hw.step_overhead
        return (self.roofline(shape) + hw.step_overhead + hw.seq_overhead * shape.seqs
                + hw.token_overhead * shape.tokens + hw.context_overhead * shape.gathered
                + self.all_reduce_time(shape.tokens, shape.sampled)
                + self.stage_time(shape.tokens, shape.sampled))

    def stage_time(self, tokens: int, sampled: int) -> float:
        """A step's hand-offs between pipeline stages (none with one stage)."""
        if self.stages == 1:
            return 0.0
        hw = self.hw
        bandwidth = hw.all_reduce_bandwidth or float("inf")
        row = 4 * self.arch.hidden_size  # float32 on the wire
        return ((self.stages - 1) * (hw.all_reduce_latency + tokens * row / bandwidth)
                + hw.all_reduce_latency + sampled * row / bandwidth)

    def all_reduce_time(self, tokens: int, sampled: int = 0) -> float:
        """A step's all-reduces of `tokens` rows and gather of `sampled` rows' logits (none
        without tensor parallelism)."""
        if not self.all_reduces:
            return 0.0
        hw = self.hw
        bandwidth = hw.all_reduce_bandwidth or float("inf")
        reduces = self.all_reduces * (hw.all_reduce_latency
                                      + tokens * self.reduce_bytes_per_token / bandwidth)
        return reduces + hw.all_reduce_latency + sampled * self.gather_bytes_per_row / bandwidth

    def step_seconds(self, shape: StepShape, draw: Callable[[], float]) -> float:
        """How long a step of `shape` takes when it runs: what `shape_time` predicts, its
        runner's part scaled by the profile's scatter at a uniform `draw()` (piecewise
        linear between the quantiles, held at the outer ones)."""
        predicted = self.shape_time(shape)
        scatter = self.hw.step_scatter
        if not scatter or predicted == 0.0:
            return predicted
        overhead = self.hw.step_overhead
        return (predicted - overhead) * _at(scatter, draw()) + overhead

    def transfer_time(self, num_tokens: int, link_bandwidth: float,
                      latency: float = 0.0) -> float:
        """Seconds to move `num_tokens` tokens of KV over a link of `link_bandwidth` B/s."""
        return latency + num_tokens * self.kv_bytes_per_token / link_bandwidth


def _at(values: list[float], u: float) -> float:
    """The distribution with `values` at ERROR_QUANTILES, at quantile u."""
    qs = ERROR_QUANTILES
    i = bisect_right(qs, u)
    if i == 0:
        return values[0]
    if i == len(qs):
        return values[-1]
    lo, hi = qs[i - 1], qs[i]
    return values[i - 1] + (values[i] - values[i - 1]) * (u - lo) / (hi - lo)
