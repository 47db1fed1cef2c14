"""KVShards: a split instance's ranks' shares of KV blocks and the whole model's layout."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tidal.engine.kv_shards import KVShards


@settings(max_examples=60, deadline=None)
@given(tp=st.integers(1, 4), stages=st.integers(1, 4), extra_layers=st.integers(0, 3),
       heads=st.sampled_from([1, 2, 4, 8]))
def test_a_split_joins_back_to_the_whole_and_each_rank_holds_its_layers_and_heads(
        tp, stages, extra_layers, heads):
    if heads > tp and heads % tp:
        return  # such a model does not split (check_shardable refuses it)
    layers = stages + extra_layers
    shards = KVShards(tp, stages, layers, heads)
    # [layers, K/V, blocks, block_size, heads, row]: each value names its layer and head
    kv = torch.arange(layers * 2 * 3 * 4 * heads * 5).view(layers, 2, 3, 4, heads, 5)
    parts = shards.split(kv)
    assert len(parts) == tp * stages
    for rank, part in enumerate(parts):
        stage, place = divmod(rank, tp)
        first, count = shards.heads_of(place)
        layer = shards.layers_of(stage)
        assert torch.equal(part, kv[layer.start:layer.stop, :, :, :, first:first + count])
    assert sum(len(shards.layers_of(s)) for s in range(stages)) == layers
    assert torch.equal(shards.join(parts), kv)
