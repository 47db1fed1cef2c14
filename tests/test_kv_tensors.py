"""The worker's KV cache tensors (`tidal/engine/kv_cache.py`): zeroed, and on a CPU backed by
pages the OS hands over only as blocks fill."""

from __future__ import annotations

import functools
import resource
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from tidal.engine.kv_cache import KVCache, cache_zeros


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


@functools.cache
def rss_is_live() -> bool:
    """Whether this kernel's resident-set count follows pages as they are written (some
    sandboxed kernels report a figure that does not move)."""
    if sys.platform != "linux":
        return False
    before = rss_bytes()
    probe = np.empty(64 << 20, dtype=np.uint8)
    probe.fill(1)
    return rss_bytes() - before > 48 << 20


def needs_live_rss() -> None:
    if not rss_is_live():
        pytest.skip("this kernel's /proc/self/statm does not follow written pages")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_cpu_pool_is_zeroed_and_takes_memory_as_its_blocks_fill(dtype):
    needs_live_rss()
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


def test_touch_keeps_what_the_blocks_hold_and_makes_them_resident():
    """What a timing run calls first (the step-time profile reads contexts nobody wrote)."""
    live = rss_is_live()
    arch = SimpleNamespace(num_kv_heads=8, head_dim=64, num_layers=2)
    before = rss_bytes()
    kv = KVCache(arch, 2047, 16, torch.float32, "cpu")  # 2 layers x K, V x 32 MiB
    assert not live or rss_bytes() - before < 16 << 20
    kv.layers[0][0][3] = 0.5  # a block a request filled
    kv.touch(list(range(kv.num_blocks + 1)))
    assert float(kv.layers[0][0][3].min()) == 0.5 and float(kv.layers[0][0][3].max()) == 0.5
    assert float(kv.layers[1][1].abs().max()) == 0 and float(kv.layers[0][0][4:].abs().max()) == 0
    if not live:
        pytest.skip("this kernel's /proc/self/statm does not follow written pages")
    assert rss_bytes() - before > 100 << 20
