"""The worker's KV cache tensors (`tidal/engine/kv_cache.py`): zeroed, and on a CPU backed by
pages the OS hands over only as blocks fill."""

from __future__ import annotations

import resource
import sys

import pytest
import torch

from tidal.engine.kv_cache import cache_zeros


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc/self/statm")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_cpu_pool_takes_memory_as_its_blocks_fill(dtype):
    shape = (4096, 16, 8, 256 // dtype.itemsize)  # 128 MiB
    before = rss_bytes()
    cache = cache_zeros(shape, dtype, "cpu")
    assert cache.shape == shape and cache.dtype == dtype and cache.is_contiguous()
    assert rss_bytes() - before < 16 << 20  # allocated, not yet touched
    cache[:64] = 1  # the blocks a few requests fill
    assert rss_bytes() - before < 32 << 20
    assert float(cache[64:].abs().max()) == 0.0 and float(cache[:64].min()) == 1.0
    cache[64:] = 2  # every block filled: the whole pool resident
    assert rss_bytes() - before > 100 << 20


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc/self/statm")
def test_touch_makes_the_pool_resident_and_keeps_what_it_holds():
    """What a timing run calls first (the step-time profile reads contexts nobody wrote)."""
    from types import SimpleNamespace

    from tidal.engine.kv_cache import KVCache

    arch = SimpleNamespace(num_kv_heads=8, head_dim=64, num_layers=2)
    before = rss_bytes()
    kv = KVCache(arch, 2047, 16, torch.float32, "cpu")  # 2 layers x K, V x 32 MiB
    assert rss_bytes() - before < 16 << 20
    kv.layers[0][0][3] = 0.5  # a block a request filled
    kv.touch()
    assert rss_bytes() - before > 100 << 20
    assert float(kv.layers[0][0][3].min()) == 0.5 and float(kv.layers[1][1].abs().max()) == 0
