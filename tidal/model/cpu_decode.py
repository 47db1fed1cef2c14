"""tidal's C++ CPU decode path (`csrc/`: the decoder, paged attention, projections, routed
experts and GGUF block formats at decode sizes), built once on first use.

A decode step of a small model on CPU is bound by per-op dispatch (~60 eager ops a layer),
so `Decoder` runs a whole decode-only step in one call: the projections stay ATen kernels,
everything between them is fused loops, and attention reads the paged cache in place.
`paged_decode_attention` is that attention on its own, for the PyTorch path's decodes
on CPU. Both are optional: without a C++ compiler tidal runs the PyTorch ops.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Iterator

import torch
from torch import nn

from tidal.model.linear import Int4Linear, PackedLinear

log = logging.getLogger("tidal.model")
_SOURCES = [str(Path(__file__).parent / "csrc" / name)  # + the headers they include
            for name in ("linear.cpp", "paged_attention.cpp", "experts.cpp", "gguf_quants.cpp",
                         "decoder.cpp")]
_built: list[ModuleType | None] = []  # [] until the first build attempt


def extension() -> ModuleType | None:
    """The compiled module, or None when it cannot be built here (said once in the log)."""
    if not _built:
        try:
            from torch.utils.cpp_extension import load

            log.info("loading tidal's C++ CPU decoder (the first build takes about a minute)")
            with warnings.catch_warnings(), _build_folder() as folder:
                warnings.simplefilter("ignore")
                _built.append(load(name="tidal_cpu_decode", sources=_SOURCES,
                                   extra_cflags=["-O3", "-march=native", "-fopenmp"],
                                   extra_ldflags=["-fopenmp"], build_directory=str(folder),
                                   verbose=False))
        except Exception as exc:  # no compiler, headers or ninja: the PyTorch ops still work
            log.warning("tidal's C++ CPU decoder could not be built (%s); decoding with "
                        "PyTorch ops", str(exc).splitlines()[0] if str(exc) else type(exc))
            _built.append(None)
    return _built[0]


@contextmanager
def _build_folder() -> Iterator[Path]:
    """The extension's build folder, held under an flock while torch builds or loads it.
    torch's own lock is a plain file that a process killed mid-build leaves behind, and
    every later build then waits on it forever; the flock dies with its process, so whoever
    holds it may remove a leftover lock file."""
    import fcntl

    from torch.utils.cpp_extension import get_default_build_root

    version = f"py{sys.version_info[0]}{sys.version_info[1]}-torch{torch.__version__}"
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()  # as torch's
    folder = Path(root) / f"tidal_cpu_decode-{version}"
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder.parent / f"{folder.name}.flock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # another tidal process building waits here
        (folder / "lock").unlink(missing_ok=True)
        yield folder


def _linear(ext: ModuleType, module: nn.Module):
    """The C++ view of one projection, or None for a kind it does not run."""
    if isinstance(module, Int4Linear):
        d = module.dense
        return ext.Linear(2, d.weight, module.bias, module.packed, module.scales_zeros,
                          module.max_rows, d.weight32, d.bias32, d.fp32_rows,
                          q4=module.ext is not None)
    if isinstance(module, PackedLinear):
        return ext.Linear(1, module.weight, module.bias, w32=module.weight32,
                          bias32=module.bias32, fp32_rows=module.fp32_rows)
    if type(module) is nn.Linear:
        return ext.Linear(0, module.weight, module.bias)
    return None


def supports(arch) -> bool:
    """Whether the C++ decoder runs this architecture: Llama's layers (biases, windows and
    partial rotary included), no q/k norms, experts or Gemma's norms and soft-caps."""
    return not (arch.qk_norm or arch.moe or arch.gemma or arch.hidden_act != "silu")


def build_decoder(model: nn.Module):
    """A C++ `Decoder` sharing `model`'s weights, or None when this model or build cannot
    use one (an architecture it does not run, not bf16 or float32, int8 projections, or no
    compiler)."""
    arch = model.arch
    if model.embed_tokens.weight.dtype not in (torch.bfloat16, torch.float32):
        return None
    if not supports(arch):
        return None
    if model.embed_tokens.weight.device.type != "cpu":
        return None
    ext = extension()
    if ext is None:
        return None
    # A tied head the runner did not convert is the embedding, as a plain linear.
    projections = [_linear(ext, model.lm_head) if model.lm_head is not None
                   else ext.Linear(0, model.embed_tokens.weight, None)]
    for layer in model.layers:
        a, m = layer.self_attn, layer.mlp
        projections += [_linear(ext, p) for p in (a.qkv_proj, a.o_proj, m.gate_up_proj,
                                                   m.down_proj)]
    if any(p is None for p in projections):
        return None
    decoder = ext.Decoder(model.embed_tokens.weight, model.norm.weight, projections[0],
                          model.rotary.cos, model.rotary.sin, arch.num_heads,
                          arch.num_kv_heads, arch.head_dim, arch.intermediate_size,
                          arch.rms_norm_eps)
    for i, layer in enumerate(model.layers):
        decoder.add_layer(layer.input_layernorm.weight, layer.post_attention_layernorm.weight,
                          *projections[1 + 4 * i:5 + 4 * i], layer.self_attn.window)
    return decoder
