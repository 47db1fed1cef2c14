"""Models whose weights stay quantized as their checkpoint holds them: a GGUF file's, in the
file's own formats (no float copy), or a GPTQ/AWQ folder's, repacked into Q4_1 blocks.

Each projection becomes a `GGUFLinear` over the quantized tensors (a fused q/k/v or
gate/up keeps each part in its own format), the embedding a `GGUFEmbedding` that
dequantizes only a step's rows, and a tied LM head multiplies the embedding's own blocks.
Float matrices (a GGUF's F32/F16/BF16, a GPTQ/AWQ checkpoint's unquantized head, and a
fused group with one among its parts) become oneDNN-packed dense layers in the model's
dtype; norms and biases are small copies.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Mapping
from pathlib import Path

import torch
from torch import nn

from tidal.model.attention import AttentionBackend, TorchAttention
from tidal.model.config import ModelArch
from tidal.model.gguf_quants import BLOCK_FIELDS, GGUFEmbedding, GGUFLinear, QuantizedWeight
from tidal.model.gguf_weights import Weight, read_gguf
from tidal.model.int4_checkpoint import read_checkpoint
from tidal.model.linear import PackedLinear, can_pack
from tidal.model.llama import LlamaModel
from tidal.model.loader import target_of
from tidal.model.tensor_parallel import Shard


def load_gguf_model(path: str | Path, arch: ModelArch, dtype: torch.dtype,
                    backend: AttentionBackend | None = None, use_extension: bool = True,
                    config: dict | None = None, shard: Shard | None = None) -> LlamaModel:
    """The model of the GGUF file at `path` (`arch` from its config), computing in `dtype`
    (bfloat16 or float32) on the CPU; `use_extension`: the C++ kernels (False: the gguf
    package dequantizes tiles, for tests and machines without a compiler); `config`: the
    file's config.json dict where the cache has it (read_gguf); `shard`: one
    tensor-parallel rank's part of it (`arch`: that part's shapes)."""
    weights = read_gguf(path, use_extension=use_extension, config=config, shard=shard)
    model = build_model(weights, arch, dtype, backend, str(path))
    model.gguf = weights  # the memory map lives as long as the model
    live = [w.data for m in model.modules() if isinstance(m, GGUFLinear) for w in m.parts]
    embed = model.embed_tokens  # a float table of the model's dtype may view the file
    live.append(embed.quantized.data if embed.quantized is not None else embed.table)
    weights.release_unused(live)
    return model


def load_int4_checkpoint(folder: str | Path, arch: ModelArch, dtype: torch.dtype,
                         backend: AttentionBackend | None = None,
                         shard: Shard | None = None) -> LlamaModel:
    """The model of a GPTQ or AWQ folder (tidal.model.int4_checkpoint), as load_gguf_model."""
    folder = Path(folder)
    config = json.loads((folder / "config.json").read_text())["quantization_config"]
    return build_model(read_checkpoint(folder, config, shard), arch, dtype, backend,
                       str(folder))


def build_model(weights: Mapping[str, Weight], arch: ModelArch, dtype: torch.dtype,
                backend: AttentionBackend | None, source: str) -> LlamaModel:
    """A LlamaModel of `weights` (Hugging Face name -> tensor or QuantizedWeight)."""
    backend = backend or TorchAttention.for_arch(arch)
    with torch.device("meta"):
        model = LlamaModel(arch, backend)
    # our name -> [(shard, weight)], the shards of a fused projection in order
    grouped: dict[str, list[tuple[int, Weight]]] = defaultdict(list)
    for name, w in weights.items():
        target, shard = target_of(name)
        if name.endswith("rotary_emb.inv_freq") or (target == "lm_head.weight"
                                                    and arch.tie_word_embeddings):
            continue
        grouped[target].append((shard or 0, w))
    for prefix, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                full = f"{prefix}.{child_name}" if prefix else child_name
                setattr(module, child_name, projection(_parts(grouped, f"{full}.weight"),
                                                       _bias(grouped, f"{full}.bias", dtype),
                                                       dtype))
    embedding = _parts(grouped, "embed_tokens.weight")[0]
    model.embed_tokens = GGUFEmbedding(embedding, dtype)
    if model.lm_head is None:  # tied: the head multiplies the embedding's own blocks
        model.lm_head = projection([embedding], None, dtype)
    rest = {name: torch.cat([w for _, w in sorted(parts, key=lambda p: p[0])]).to(dtype)
            for name, parts in grouped.items()}
    model.load_state_dict(rest, assign=True, strict=False)
    missing = [name for name, p in model.named_parameters() if p.is_meta]
    unused = sorted(set(rest) - {name for name, _ in model.named_parameters()})
    if missing or unused:
        raise ValueError(f"{source}: missing weights {missing[:5]}, unexpected {unused[:5]}")
    return model.eval().requires_grad_(False)


def projection(parts: list[Weight], bias: torch.Tensor | None,
               dtype: torch.dtype) -> nn.Module:
    """One projection over the parts (stacked on the output dim): a GGUFLinear when every
    part is of a block format, else a dense layer of the parts' values in `dtype`."""
    if all(isinstance(w, QuantizedWeight) and w.qtype in BLOCK_FIELDS for w in parts):
        return GGUFLinear(parts, bias)
    dense = torch.cat([_values(w, dtype) for w in parts])
    if can_pack(dtype, "cpu"):
        return PackedLinear(dense, bias)
    layer = nn.Linear(dense.shape[1], dense.shape[0], bias=bias is not None, dtype=dtype)
    layer.weight.data, layer.bias = dense, None if bias is None else nn.Parameter(bias)
    return layer.requires_grad_(False)


def _values(w: Weight, dtype: torch.dtype) -> torch.Tensor:
    if not isinstance(w, QuantizedWeight):
        return w.to(dtype)
    values = w.dequantize_rows(0, w.shape[0], dtype)
    if w.in_perm is None:
        return values
    return torch.empty_like(values).index_copy_(1, w.in_perm, values)  # the features' order


def _parts(grouped: dict[str, list[tuple[int, Weight]]], name: str) -> list[Weight]:
    if name not in grouped:
        raise ValueError(f"the checkpoint has no tensor for {name}")
    return [w for _, w in sorted(grouped.pop(name), key=lambda p: p[0])]


def _bias(grouped: dict[str, list[tuple[int, Weight]]], name: str,
          dtype: torch.dtype) -> torch.Tensor | None:
    if name not in grouped:
        return None
    return torch.cat(_parts(grouped, name)).to(dtype)
