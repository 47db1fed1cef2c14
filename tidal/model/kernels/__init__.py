"""Triton kernels for the GPU path (optional: `pip install tidal[gpu]`). Each takes the same
arguments and layouts as the PyTorch or C++ code it stands in for, and equals it: the tests
run the kernels under `TRITON_INTERPRET=1` on CPU tensors."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class FusedKernels:
    """What `LlamaModel.kernels` calls in place of chains of eager ops: RMSNorm, residual add
    + RMSNorm, and RoPE + KV-cache write (tidal.model.kernels.norm, .rope_cache)."""

    rms_norm: Callable
    add_rms_norm: Callable
    rope_and_cache: Callable


def fused_kernels() -> FusedKernels | None:
    """The fused kernels, or None where triton is not installed."""
    try:
        from tidal.model.kernels.norm import fused_add_rms_norm, rms_norm
        from tidal.model.kernels.rope_cache import rope_and_cache
    except ImportError:
        return None
    return FusedKernels(rms_norm, fused_add_rms_norm, rope_and_cache)


def paged_prefill_kernel():
    """Triton's paged prefill attention, or None where triton is not installed."""
    try:
        from tidal.model.kernels.prefill_attention import paged_prefill_attention
    except ImportError:
        return None
    return paged_prefill_attention


def paged_decode_kernel():
    """Triton's paged decode attention, or None where triton is not installed."""
    try:
        from tidal.model.kernels.paged_attention import paged_decode_attention
    except ImportError:
        return None
    return paged_decode_attention
