"""The batched LoRA kernel of Triton (under its interpreter without CUDA) against a float64
reference (`lora_reference.py`: rows of several slots in any order, the fused projections'
block-diagonal B, ranks, inputs and outputs of no round size, float32 and bf16, and bf16
weights under float32 rows). The C++ kernel's test is `test_lora_kernel_cpp.py`, which runs
without Triton."""

from __future__ import annotations

import pytest

from triton_setup import DEVICE  # first: sets Triton's interpreter up without CUDA

from lora_reference import DTYPES, SHAPES, check_kernel
from tidal.model.kernels.lora import lora_add


@pytest.mark.parametrize("dtype, wdtype", DTYPES)
@pytest.mark.parametrize("outs, k, rank", SHAPES)
def test_the_triton_kernel_equals_the_reference(dtype, wdtype, outs, k, rank):
    check_kernel(lora_add, DEVICE, dtype, wdtype, outs, k, rank)
