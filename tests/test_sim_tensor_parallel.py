"""The simulator's tensor parallelism: a replica split over devices as tidal splits a model
(tidal/sim/cost_model.py, tidal/sim/build.py)."""

from __future__ import annotations

import pytest

from tidal.model.config import shard_arch
from tidal.sim.build import build_simulator
from tidal.sim.cost_model import CostModel, StepShape
from tidal.sim.profiles import Hardware, kv_blocks_for, model_arch

ARCH = model_arch("llama-3-8b")


def test_tensor_parallel_ranks_split_the_weights_and_kv_and_pay_two_all_reduces_a_layer():
    """A rank of a split Llama-3-8B reads about half the weights (the embedding and head
    stay whole on each) and holds more than twice the KV blocks; each step adds two
    all-reduces a layer, each its latency and its rows' bytes over the bandwidth; a 70B
    fits four H100s and not two; what does not split is refused naming the flag."""
    free = Hardware("h100-free-links", 989e12, 3.35e12, 80e9)  # all-reduces cost nothing
    one, two = CostModel(ARCH, free), CostModel(shard_arch(ARCH, 2), free, tp=2)
    decode = StepShape([(1, 100, True)] * 8)
    embed = ARCH.vocab_size * ARCH.hidden_size * free.dtype_bytes
    assert two.weight_bytes - embed == pytest.approx((one.weight_bytes - embed) / 2, rel=0.01)
    assert 0.5 < two.roofline(decode) / one.roofline(decode) < 0.6
    assert two.shape_time(decode) == pytest.approx(two.roofline(decode))
    slow = Hardware("h100-slow-links", 989e12, 3.35e12, 80e9, all_reduce_latency=1e-4,
                    all_reduce_bandwidth=1e9)
    added = CostModel(shard_arch(ARCH, 2), slow, tp=2).shape_time(decode) - two.shape_time(decode)
    assert added == pytest.approx(2 * ARCH.num_layers * (1e-4 + 8 * ARCH.hidden_size * 2 / 1e9))
    blocks = [kv_blocks_for(shard_arch(ARCH, n), free, 16) for n in (1, 2)]
    assert blocks[1] > 2 * blocks[0]
    with pytest.raises(ValueError, match="no room for a KV cache"):
        build_simulator("llama-3-70b", "h100", {"tensor_parallel_size": 2})
    _, _, _, config = build_simulator("llama-3-70b", "h100", {"tensor_parallel_size": 4})
    assert config.cache.num_blocks > 0
    with pytest.raises(ValueError, match="--tensor-parallel-size 3 does not divide"):
        build_simulator("llama-3-8b", "h100", {"tensor_parallel_size": 3})
