"""Where a model runner runs and in what dtype, and how much memory its KV cache gets."""

from __future__ import annotations

import os
from typing import Callable

import torch

from tidal.model.linear import bf16_kernels, cpu_flags

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def pick_device(name: str) -> str:
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return name


def core_device(name: str, index: int) -> str:
    """Engine core `index`'s device: with several GPUs, data-parallel core i runs on GPU
    i modulo their number; otherwise the configured device."""
    if name in ("auto", "cuda") and torch.cuda.is_available() and torch.cuda.device_count() > 1:
        return f"cuda:{index % torch.cuda.device_count()}"
    return name


def cpu_has_bf16() -> bool:
    """Native bf16 arithmetic (AVX512-BF16 or AMX): where bf16 is the faster CPU dtype."""
    return bool({"avx512_bf16", "amx_bf16"} & cpu_flags()) and bf16_kernels()


OWN_FORMATS = ("gguf", "gptq", "awq")  # quantizations that run the GGUF integer kernels


def pick_dtype(name: str, device: str, quantization: str = "none") -> torch.dtype:
    """`auto`: float32 for weights in their own formats on CPU (the integer kernels cost
    the same with float32 activations, and a near-tie between two tokens then falls as the
    float32 reference's does, where bf16 hidden states and KV flip the embedded model's
    answer to the README's first question); bf16 on GPUs and on CPUs with native bf16; on
    other CPUs float32, except for int8/int4 weights, whose torch kernels vectorise bf16
    activations only (8-13x faster)."""
    if name == "auto" and quantization in OWN_FORMATS and not device.startswith("cuda"):
        return torch.float32
    if name == "auto":
        bf16 = device.startswith("cuda") or cpu_has_bf16() or quantization != "none"
        return torch.bfloat16 if bf16 else torch.float32
    return _DTYPES[name]


def pick_kv_cache_dtype(name: str, device: str, quantization: str, dtype: torch.dtype) -> str:
    """`auto`: the model's dtype, except bf16 rows under a float32 model of weights in their
    own formats on a CPU with AMX or AVX512-BF16: there a decode step of many rows spends
    about a third of its time reading K and V (AMX: the embedded model served to 64 clients
    ran 1.14x the tokens/s of float32 rows), and prompt attention over bf16 rows runs in bf16
    (AMX's SDPA; elsewhere tidal's C++ kernel with bf16 products: 1,000-token prompts served
    16 at a time 1.07x on a Zen 4). A short prompt's own attention reads its float32 k and v
    either way."""
    if (name == "auto" and quantization in OWN_FORMATS and device == "cpu"
            and dtype == torch.float32 and {"amx_bf16", "avx512_bf16"} & cpu_flags()):
        return "bfloat16"
    return name


def free_ram() -> int:
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def gpu_kv_budget(device: str, utilization: float, profile: Callable[[], None]) -> int:
    """Bytes the KV cache may take on a GPU: `utilization` of its memory less what the
    weights hold, the peak of `profile` (a forward pass of the largest step: its
    activations) and what other processes hold (vLLM's rule)."""
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    profile()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    others = total - free - torch.cuda.memory_reserved(device)
    return int(total * utilization) - peak - others
