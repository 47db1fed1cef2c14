"""Import first in a test module of tidal's Triton kernels: without CUDA the kernels run under
Triton's interpreter (TRITON_INTERPRET=1, read when they are decorated) on CPU tensors, so CI
checks the code a GPU compiles. The importing module is skipped where triton is not installed
(the `gpu` extra) or where its interpreter cannot run (before triton 3.8, with NumPy 2)."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
triton = pytest.importorskip("triton")
if not torch.cuda.is_available() and tuple(map(int, triton.__version__.split(".")[:2])) < (3, 8):
    pytest.skip("Triton's interpreter runs with NumPy 2 from triton 3.8 on",
                allow_module_level=True)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def random_cache(gen: torch.Generator, lens: list[int], block_size: int, kv_heads: int,
                 head_dim: int, dtype: torch.dtype, kv: str = "auto"):
    """(k_cache, v_cache, tables): random caches with 4 blocks to spare and, per sequence, a
    shuffled table as wide as the longest context (tables may share blocks); with `kv` a
    quantized format, of its rows (tidal.model.kv_quant)."""
    from tidal.model.kv_quant import KVFormat

    width = max(-(-n // block_size) for n in lens)
    num_blocks = width + 4
    fmt = KVFormat(kv)
    k_cache, v_cache = (
        fmt.encode(x).view(fmt.storage(dtype)) if fmt.quantized else x.to(dtype)
        for x in (torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen)
                  for _ in range(2)))
    tables = torch.stack([torch.randperm(num_blocks, generator=gen)[:width]
                          for _ in lens]).to(torch.int32)
    return k_cache, v_cache, tables
