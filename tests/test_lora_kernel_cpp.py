"""The C++ batched LoRA kernel (`csrc/lora.cpp`) against a float64 reference
(`lora_reference.py`), on every machine tidal's extension builds on: slots of more rows than
one of its blocks, ranks, inputs and outputs of no round size, float32 and bf16 (and bf16
weights under float32 rows)."""

from __future__ import annotations

import pytest

from lora_reference import DTYPES, SHAPES, check_kernel
from tidal.model.cpu_extension import extension

pytestmark = pytest.mark.skipif(extension() is None, reason="needs tidal's C++ extension")


@pytest.mark.parametrize("dtype, wdtype", DTYPES)
@pytest.mark.parametrize("outs, k, rank", SHAPES)
def test_the_cpp_kernel_equals_the_reference(dtype, wdtype, outs, k, rank):
    check_kernel(extension().lora_add, "cpu", dtype, wdtype, outs, k, rank)
