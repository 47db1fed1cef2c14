"""Build a model and load Hugging Face safetensors into it, fusing q/k/v and gate/up, the
experts' too (Phi-3 checkpoints store them fused already, under the names tidal uses)."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import torch

from tidal.model.attention import AttentionBackend, TorchAttention
from tidal.model.config import ModelArch
from tidal.model.llama import LlamaModel, Rotary
from tidal.model.registry import dense_weights, gguf_source
from tidal.model.tensor_parallel import Shard

log = logging.getLogger("tidal.model")

# An HF projection's last name -> (our fused projection, which shard of it). w1/w3/w2 are
# Mixtral's expert gate/up/down.
_SHARDS = {
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    "w1": ("gate_up_proj", 0), "w3": ("gate_up_proj", 1),
}
_RENAMES = {"block_sparse_moe": "mlp", "w2": "down_proj"}  # Mixtral's module names
# `model.` is absent from a bare body's checkpoint (an embedding model's: Qwen3-Embedding)
_LAYER = re.compile(r"^(?:model\.)?layers\.(\d+)\.(.+)\.(weight|bias)$")


def target_of(name: str) -> tuple[str, int | None]:
    """Our parameter name for an HF one, and its shard index when fused."""
    m = _LAYER.match(name)
    if m:
        layer, module, kind = m.groups()
        parts = [_RENAMES.get(p, p) for p in module.split(".")]
        shard = None
        if parts[-1] in _SHARDS:
            parts[-1], shard = _SHARDS[parts[-1]]
        return f"layers.{layer}.{'.'.join(parts)}.{kind}", shard
    if name == "lm_head.weight":
        return name, None
    return name.removeprefix("model."), None


def _shard_sizes(arch: ModelArch, fused: str, rows: int) -> list[int]:
    if fused.endswith("qkv_proj.weight") or fused.endswith("qkv_proj.bias"):
        return [arch.num_heads * arch.head_dim] + [arch.num_kv_heads * arch.head_dim] * 2
    return [rows // 2] * 2  # gate and up: the dense MLP's, an expert's or the shared one's


def load_model(folder: str | Path, dtype: torch.dtype, device: str = "cpu",
               backend: AttentionBackend | None = None, dummy: bool = False,
               shard: Shard | None = None) -> LlamaModel:
    """A model with the weights of `folder` (config.json + *.safetensors), in `dtype`.
    `dummy`: small random weights instead (needs only config.json), for timing models whose
    weights are not here, as vLLM's `--load-format dummy`. `shard`: one tensor-parallel
    rank's part of each tensor, cut as it is read."""
    folder = Path(folder)
    arch = ModelArch.from_folder(folder)
    if shard is not None:
        arch = shard.part
    backend = backend or TorchAttention.for_arch(arch)
    if dummy:
        default = torch.get_default_dtype()
        torch.set_default_dtype(dtype)  # built in it: an 8B model in float32 fills an H100
        try:
            with torch.device(device):
                model = LlamaModel(arch, backend)
        finally:
            torch.set_default_dtype(default)
        for p in model.parameters():
            p.data.uniform_(-0.02, 0.02)
        for name, p in model.named_parameters():
            if "norm" in name:
                p.data.fill_(1.0)
        # The RoPE tables stay float32, as loaded models keep them.
        model.rotary = Rotary(arch).to(device)
        return model.eval().requires_grad_(False)
    if not any(folder.glob("*.safetensors")) and gguf_source(folder) is not None:
        dense_weights(folder)  # a GGUF run that asks for dense weights
    with torch.device("meta"):
        model = LlamaModel(arch, backend)
    params = _read_safetensors(folder, arch, model, dtype, shard)
    fold_multipliers(arch, params)
    model.load_state_dict(params, assign=True, strict=False)
    return model.to(device).eval().requires_grad_(False)


# the projections whose products join the residual stream (a bias with its weight)
_RESIDUAL_BRANCHES = tuple(f"{p}.{kind}" for p in ("self_attn.o_proj", "mlp.down_proj")
                           for kind in ("weight", "bias"))


def fold_multipliers(arch: ModelArch, params: dict[str, torch.Tensor]) -> None:
    """Granite's scalars folded into its weights, in place, so that every path (the PyTorch
    layers, fused kernels, the C++ decoder, tensor and pipeline ranks) runs it as Llama:
    residual_multiplier into each branch's last projection, embedding_multiplier into the
    embeddings, and `arch.head_fold` into the final norm (the model divides the final
    hidden states it returns for pooling by it again)."""
    if arch.residual_multiplier != 1.0:
        for name, tensor in params.items():
            if name.endswith(_RESIDUAL_BRANCHES):
                tensor.mul_(arch.residual_multiplier)
    for name, scale in (("embed_tokens.weight", arch.embedding_multiplier),
                        ("norm.weight", arch.head_fold)):
        if name in params and scale != 1.0:
            params[name].mul_(scale)


def _read_safetensors(folder: Path, arch: ModelArch, model: LlamaModel, dtype: torch.dtype,
                      shard: Shard | None) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    params = dict(model.named_parameters())
    loaded: dict[str, torch.Tensor] = {}
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {folder}")
    for path in files:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():
                if name.endswith("rotary_emb.inv_freq"):
                    continue
                local = name if shard is None else shard.local_name(name)
                if local is None:  # a layer or routed expert another rank holds
                    continue
                target, part = target_of(local)
                if (target == "lm_head.weight" and arch.tie_word_embeddings) or \
                        target.startswith("score."):  # a classifier's head: score_head.py's
                    continue
                if target not in params:
                    raise KeyError(f"{path.name}: unexpected tensor {name!r}")
                if target not in loaded:
                    loaded[target] = torch.empty(params[target].shape, dtype=dtype)
                tensor = f.get_tensor(name)
                tensor = (tensor if shard is None else shard.take(name, tensor)).to(dtype)
                if part is None:
                    loaded[target].copy_(tensor)
                else:
                    sizes = _shard_sizes(arch, target, params[target].shape[0])
                    offset = sum(sizes[:part])
                    loaded[target][offset:offset + sizes[part]].copy_(tensor)
    missing = sorted(set(params) - set(loaded))
    if missing == ["lm_head.weight"] and "embed_tokens.weight" in loaded:
        # a body without its head (an embedding model): the head is never read for its
        # embeddings, and the tied embeddings give it a shape and a meaning
        log.warning("%s: no LM head; it is tied to the embeddings (text generated with this "
                    "model means nothing)", folder)
        loaded["lm_head.weight"] = loaded["embed_tokens.weight"]
        missing = []
    if missing:
        raise KeyError(f"{folder}: missing weights {missing[:5]}")
    return loaded
