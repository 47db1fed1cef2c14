"""A model folder (or GGUF) as the model runner computes with it: its weights in the layers
its device and quantization call for, and the C++ decoder of its decode steps on CPU."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tidal.engine.config import ModelConfig
from tidal.engine.device import pick_dtype
from tidal.model import cpu_decode
from tidal.model.attention import AttentionBackend
from tidal.model.batch_invariant import make_batch_invariant
from tidal.model.config import TP_FLAG, ModelArch
from tidal.model.gguf_quants import PromptRows
from tidal.model.linear import (Int4Linear, Int8Linear, PackedLinear, can_pack,
                                default_fp32_rows, replace_linears)
from tidal.model.loader import load_model
from tidal.model.mlp import group_experts
from tidal.model.quantized_model import load_gguf_model, load_int4_checkpoint
from tidal.model.registry import gguf_source
from tidal.model.tensor_parallel import Shard, TPGroup, split_model


def effective_quantization(config: ModelConfig, source: str, device: str) -> str:
    """What `config.quantization` means for a model whose checkpoint is `source` ('gguf',
    'gptq', 'awq', or '' for dense safetensors) on `device`: 'auto' resolved, and a
    combination that cannot run refused by name."""
    q = config.quantization
    if source in ("gptq", "awq") and q not in ("auto", source):
        raise ValueError(f"{config.model!r} is a {source} checkpoint: it runs in its own "
                         f"format (quantization auto or {source}), not {q!r}")
    if q == "auto":
        if source in ("gptq", "awq"):
            q = source
        else:
            dense_dtype = config.dtype in ("float32", "float16")
            use = source == "gguf" and device == "cpu" and not dense_dtype \
                and config.load_format == "auto"
            return "gguf" if use else "none"
    if q in ("gguf", "gptq", "awq"):
        if source != q:
            raise ValueError(f"quantization={q!r} runs {q} checkpoints; {config.model!r} is "
                             "not one")
        if device != "cpu":
            raise ValueError(f"quantization={q!r} runs on CPU; on GPU use a dense checkpoint"
                             + (" or quantization 'none'" if q == "gguf" else ""))
        if config.dtype == "float16":
            raise ValueError(f"quantization={q!r} computes in bfloat16 or float32, not float16")
    return q


def pick_model_dtype(folder: str | Path, arch: ModelArch, config: ModelConfig,
                     device: str) -> tuple[str, torch.dtype]:
    """(quantization, dtype) the model in `folder` runs with on `device` under `config`."""
    gguf = gguf_source(folder)
    source = "gguf" if gguf is not None else arch.quant_method
    quantization = effective_quantization(config, source, device)
    return quantization, pick_dtype(config.dtype, device, quantization)


def load_for_runner(folder: str | Path, arch: ModelArch, config: ModelConfig, device: str,
                    dtype: torch.dtype, quantization: str, backend: AttentionBackend,
                    ext, tp: TPGroup | None = None, shard: Shard | None = None,
                    ) -> tuple[torch.nn.Module, object | None]:
    """The model and (with the CPU extension `ext`) its C++ decoder; with `tp` and `shard`,
    this rank's part of a dense model or of a checkpoint's own formats (GGUF, GPTQ, AWQ),
    cut as read (tidal.model.tensor_parallel), whose split modules meet the other ranks'
    (in the C++ decoder too: through shared memory on one machine, else torch.distributed)."""
    if tp is not None and quantization in ("int8", "int4"):
        raise ValueError(f"{TP_FLAG} {tp.size}: tensor parallelism splits dense weights and "
                         f"a checkpoint's own formats, not --quantization {quantization}")
    part = arch if shard is None else shard.part  # the shapes built
    if quantization == "gguf":  # every projection is a CPU layer of the file's formats
        config_json = json.loads((Path(folder) / "config.json").read_text())
        model = load_gguf_model(gguf_source(folder), part, dtype, backend,
                                config=config_json, shard=shard)
    elif quantization in ("gptq", "awq"):
        model = load_int4_checkpoint(folder, part, dtype, backend, shard)
    else:
        model = load_model(folder, dtype, device, backend,
                           dummy=config.load_format == "dummy", shard=shard)
        convert_layers(model, config, quantization, dtype, device, ext)
    if config.prompt_rounding == "twice":  # the layers of the kernels' formats, if any
        PromptRows.attach(model)
    if tp is not None:
        split_model(model, tp, shard)
        if ext is None:
            return model, None
        reduce = tp.shm.use_extension(ext) if tp.shm is not None else tp.sum_in_place
        return model, cpu_decode.build_decoder(model, reduce)
    if config.deterministic:  # before the decoder, which takes the layers as they are
        make_batch_invariant(model)
    # Decode-only steps run as one C++ call where the model allows (CPU).
    return model, cpu_decode.build_decoder(model) if ext and config.cpu_decoder else None


def convert_layers(model: torch.nn.Module, config: ModelConfig, quantization: str,
                   dtype: torch.dtype, device: str, ext) -> None:
    """Dense weights into their device's layers: CPU projections packed or quantized,
    experts grouped."""
    kind = {"none": PackedLinear, "int8": Int8Linear, "int4": Int4Linear}[quantization]
    if can_pack(dtype, device):  # CPU: every projection gets its CPU layer
        if kind is PackedLinear:  # experts: tidal's kernel reads bf16 itself; torch's float32
            group_experts(model, dtype if ext else torch.float32, ext and ext.grouped_linear)
        rows = default_fp32_rows() if config.fp32_gemm_rows is None else config.fp32_gemm_rows
        options = {PackedLinear: {"fp32_rows": rows}, Int8Linear: {},
                   Int4Linear: {"fp32_rows": rows, "ext": ext}}[kind]
        replace_linears(model, kind, **options)
    elif quantization != "none":
        raise ValueError(f"quantization={quantization!r} runs on CPU in bfloat16 or float32")
    elif device.startswith("cuda"):  # experts as torch's grouped matmul: no per-expert host loop
        group_experts(model, dtype)
