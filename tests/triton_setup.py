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

from paged_reference import random_cache  # noqa: E402,F401  (imported from here)
