"""Triton kernels for the GPU path (optional: `pip install tidal[gpu]`). Each takes the same
arguments and layouts as the PyTorch or C++ code it stands in for, and equals it: the tests
run the kernels under `TRITON_INTERPRET=1` on CPU tensors. On CPU the C++ extension's loops
stand in for the fused ones (`cpu_fused_kernels`)."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class FusedKernels:
    """What `LlamaModel.kernels` calls in place of chains of eager ops: RMSNorm, residual add
    + RMSNorm, and RoPE + KV-cache write (tidal.model.kernels.norm, .rope_cache on GPU; the
    C++ extension's fused_ops.cpp on CPU, whose RoPE rotates q and k in place)."""

    rms_norm: Callable
    add_rms_norm: Callable
    rope_and_cache: Callable
    silu_mul: Callable | None = None  # (gate_up, dtype) -> SiLU(gate) * up (MLP.fused)


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


def cpu_fused_kernels(ext) -> FusedKernels:
    """The C++ extension's (`ext`, tidal.model.cpu_extension) fused loops: the C++ decoder's
    RMSNorm, residual add and RoPE, its KV write for every cache format, and SiLU * up."""
    return FusedKernels(ext.rms_norm, ext.fused_add_rms_norm, ext.rope_and_cache,
                        ext.silu_mul)


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
