"""Triton kernels for the GPU path (optional: `pip install tidal[gpu]`). Each takes the same
arguments and layouts as the PyTorch or C++ code it stands in for, and equals it: the tests
run the kernels under `TRITON_INTERPRET=1` on CPU tensors."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class FusedKernels:
    """What `LlamaModel.kernels` calls in place of chains of eager ops: RMSNorm, residual add
    + RMSNorm, and RoPE + KV-cache write (tidal.model.kernels.norm, .rope_cache)."""

    rms_norm: Callable
    add_rms_norm: Callable
    rope_and_cache: Callable


def _optional(module: str, name: str) -> Callable | None:
    """tidal.model.kernels.<module>.<name>, or None where triton is not installed."""
    try:
        return getattr(importlib.import_module(f"tidal.model.kernels.{module}"), name)
    except ImportError:
        return None


def fused_kernels() -> FusedKernels | None:
    """The fused kernels, or None where triton is not installed."""
    parts = (_optional("norm", "rms_norm"), _optional("norm", "fused_add_rms_norm"),
             _optional("rope_cache", "rope_and_cache"))
    return None if None in parts else FusedKernels(*parts)


def paged_prefill_kernel() -> Callable | None:
    """Triton's paged prefill attention, or None where triton is not installed."""
    return _optional("prefill_attention", "paged_prefill_attention")


def paged_decode_kernel() -> Callable | None:
    """Triton's paged decode attention, or None where triton is not installed."""
    return _optional("paged_attention", "paged_decode_attention")


def lora_kernel() -> Callable | None:
    """Triton's batched LoRA deltas (the C++ lora_add's arguments), or None where triton is
    not installed."""
    return _optional("lora", "lora_add")
