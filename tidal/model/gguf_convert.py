"""Convert a GGUF file into a Hugging Face style folder, once.

The folder holds float32 `model.safetensors` (Q4_1/Q8_0 dequantize exactly to float32, not to
bfloat16: a float32 run must match the HF reference token for token), `config.json`,
`generation_config.json` (the tokens llama.cpp ends a generation at, the file's sampling
defaults), and the tokenizer with its chat template, all built from the GGUF file.

Tensor names are llama.cpp's renaming read backwards: gguf's `TensorNameMap` gives the GGUF
name of each Hugging Face checkpoint name for the file's architecture. Stacked expert tensors
are split into the per-expert tensors HF checkpoints hold. config.json takes transformers'
GGUF field mapping (plus the fields it lacks) over the defaults of the model_type's config
class.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

# GGUF architecture -> its key in transformers' GGUF config mapping (and model_type).
ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "phi3": "phi3",
                 "qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe", "gemma2": "gemma2",
                 "gemma3": "gemma3"}
# A gemma3 GGUF holds the text model only (transformers' GGUF loader reads it the same way).
_TEXT_ONLY = {"gemma3": "gemma3_text"}
# Metadata llama.cpp writes for these architectures that transformers' mapping leaves out.
_EXTRA_FIELDS = {
    "attention.key_length": "head_dim",
    "attention.sliding_window": "sliding_window",
    "rope.freq_base_swa": "rope_local_base_freq",
    "expert_count": "num_experts",
    "expert_used_count": "num_experts_per_tok",
    "expert_feed_forward_length": "moe_intermediate_size",
    "expert_shared_feed_forward_length": "shared_expert_intermediate_size",
    "expert_weights_norm": "norm_topk_prob",
    "attn_logit_softcapping": "attn_logit_softcapping",
    "final_logit_softcapping": "final_logit_softcapping",
}
# Layer count of the 27B Gemma 2 / 3, which llama.cpp scales queries by 1/sqrt(hidden/heads).
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
# Hugging Face checkpoint names ({bid}: layer) that llama.cpp renames to GGUF names.
_HF_NAMES = ["model.embed_tokens", "model.norm", "lm_head"] + [
    f"model.layers.{{bid}}.{n}" for n in (
    "input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
    "post_feedforward_layernorm", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
    "self_attn.o_proj", "self_attn.qkv_proj", "self_attn.q_norm", "self_attn.k_norm",
    "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "mlp.gate_up_proj", "mlp.gate",
    "mlp.experts.gate_proj", "mlp.experts.up_proj", "mlp.experts.down_proj",
    "mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj", "mlp.shared_expert.down_proj",
    "mlp.shared_expert_gate")]
# Llama 3.x's RoPE schedule as llama.cpp bakes it into rope_freqs; the GGUF keeps no
# low/high frequency factors, and every Llama 3.x uses these.
_LLAMA3_LOW, _LLAMA3_HIGH, _LLAMA3_ORIGINAL = 1.0, 4.0, 8192


def _unpermute(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's row permutation of q/k (its RoPE pairs neighbours, HF's pairs halves)."""
    rows = w.shape[0]
    return (w.reshape(num_heads, rows // num_heads // 2, 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def _field(reader, key: str, default=None):
    from gguf import GGUFValueType

    f = reader.fields.get(key)
    if f is None:
        return default
    value = f.contents()
    if f.types == [GGUFValueType.FLOAT32]:  # its shortest decimal: what config.json held
        value = float(str(np.float32(value)))  # 1e-06, not 9.99999997e-07
    return value


def _llama3_factors(wavelen: np.ndarray, factor: float, original: float) -> np.ndarray:
    """llama.cpp's rope_freqs for a llama3 schedule: per-pair divisors of the frequencies."""
    smooth = (original / wavelen - _LLAMA3_LOW) / (_LLAMA3_HIGH - _LLAMA3_LOW)
    return np.where(wavelen < original / _LLAMA3_HIGH, 1.0,
                    np.where(wavelen > original / _LLAMA3_LOW, factor,
                             1 / ((1 - smooth) / factor + smooth)))


def _llama3_rope(arch: str, divisors: np.ndarray, theta: float, factor, original) -> dict:
    """The llama3 rope_parameters whose divisors are `divisors` (metadata's factor and
    original context where present, else read off the tensor); ValueError if none fits."""
    dim = 2 * len(divisors)
    wavelen = 2 * math.pi * theta ** (np.arange(0, dim, 2) / dim)
    factor = float(factor or divisors.max())
    if factor == 1.0 and np.allclose(divisors, 1.0):
        return {}
    mid = (divisors > 1 + 1e-6) & (divisors < factor * (1 - 1e-6))
    if original is None and mid.any():  # a smoothed pair pins the original context length
        i = int(np.argmax(mid))
        smooth = (1 / divisors[i] - 1 / factor) / (1 - 1 / factor)
        original = wavelen[i] * (_LLAMA3_LOW + smooth * (_LLAMA3_HIGH - _LLAMA3_LOW))
    original = round(original or _LLAMA3_ORIGINAL)
    if not np.allclose(_llama3_factors(wavelen, factor, original), divisors, rtol=1e-4):
        raise ValueError(f"{arch} GGUF: its rope_freqs tensor matches no llama3 RoPE schedule "
                         f"(low/high frequency factors {_LLAMA3_LOW}/{_LLAMA3_HIGH}); "
                         "cannot derive rope_parameters")
    return {"rope_type": "llama3", "factor": factor, "low_freq_factor": _LLAMA3_LOW,
            "high_freq_factor": _LLAMA3_HIGH, "original_max_position_embeddings": original}


def _rope_scaling(reader, arch: str, theta: float) -> dict:
    """rope_parameters fields beyond theta, from rope.scaling.* and llama.cpp's rope tensors."""
    g = lambda k: _field(reader, f"{arch}.rope.scaling.{k}")  # noqa: E731
    kind, factor, original = g("type"), g("factor"), g("original_context_length")
    tensors = {t.name: t for t in reader.tensors}
    if "rope_freqs.weight" in tensors:
        from gguf.quants import dequantize

        t = tensors["rope_freqs.weight"]
        divisors = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float64).reshape(-1)
        return _llama3_rope(arch, divisors, theta, factor, original)
    if "rope_factors_long.weight" in tensors:
        raise ValueError(f"{arch} GGUF: LongRoPE (rope_factors_long/short tensors) does not "
                         "convert")
    if kind in (None, "none"):
        return {}
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(factor)}
    if kind == "yarn":
        extra = {hf: float(v) for k, hf in (("yarn_beta_fast", "beta_fast"),
                                            ("yarn_beta_slow", "beta_slow"))
                 if (v := g(k)) is not None}
        return {"rope_type": "yarn", "factor": float(factor),
                "original_max_position_embeddings": int(original), **extra}
    raise ValueError(f"{arch} GGUF: RoPE scaling type {kind!r} does not convert")


def hf_config(reader) -> dict:
    """config.json for the GGUF's architecture: its metadata renamed as transformers' GGUF
    loader renames it. A field the file leaves out is left out, as Hugging Face checkpoints
    leave out their defaults: transformers' config class and `ModelArch` read the same
    default (transformers' config classes import torch, seconds of a first start).
    ValueError for an architecture (or RoPE schedule) that does not convert."""
    from transformers.integrations.ggml import (GGUF_CONFIG_DEFAULTS_MAPPING,
                                                GGUF_CONFIG_MAPPING)

    from tidal.model.config import FAMILIES

    arch = _field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(f"GGUF architecture {arch!r} does not convert (tidal converts "
                         f"{', '.join(ARCHITECTURES)})")
    key = ARCHITECTURES[arch]
    model_type = _TEXT_ONLY.get(key, key)
    if arch == "llama" and _field(reader, "llama.expert_count"):
        raise ValueError("llama GGUF with experts (Mixtral) does not convert")
    fields = dict(GGUF_CONFIG_DEFAULTS_MAPPING.get(key, {}))
    for prefix, renames in ((arch, {**GGUF_CONFIG_MAPPING[key], **_EXTRA_FIELDS}),
                            ("tokenizer", GGUF_CONFIG_MAPPING["tokenizer"])):
        for gguf_key, hf_key in renames.items():
            value = _field(reader, f"{prefix}.{gguf_key}")
            if hf_key not in (None, -1) and value is not None:  # None: transformers drops it
                fields[hf_key] = value
    hidden, heads = fields["hidden_size"], fields["num_attention_heads"]
    head_dim = fields.setdefault("head_dim", hidden // heads)
    fields.setdefault("num_key_value_heads", heads)  # older files: no grouped queries
    tensors = {t.name: t for t in reader.tensors}
    fields["vocab_size"] = int(tensors["token_embd.weight"].shape[-1])  # rows actually stored
    fields["tie_word_embeddings"] = "output.weight" not in tensors
    if not fields.get("sliding_window"):  # llama.cpp writes 0 for "no window"
        fields.pop("sliding_window", None)
    if (pattern := _field(reader, f"{arch}.attention.sliding_window_pattern")) is not None:
        fields["layer_types"] = ["sliding_attention" if s else "full_attention" for s in pattern]
    if key in _GEMMA_27B_LAYERS:  # the query scaling llama.cpp applies
        big = fields["num_hidden_layers"] == _GEMMA_27B_LAYERS[key]
        fields["query_pre_attn_scalar"] = hidden // heads if big else head_dim
    theta = float(fields.get("rope_theta", 10000.0))
    rope = _rope_scaling(reader, arch, theta)
    rotary = _field(reader, f"{arch}.rope.dimension_count")
    if rotary and rotary != head_dim:
        rope = {"rope_type": "default", **rope, "partial_rotary_factor": rotary / head_dim}
    if key == "gemma3":  # a schedule per layer type: sliding layers turn at their own base
        local = fields.pop("rope_local_base_freq", 10000.0)
        fields["rope_parameters"] = {
            "full_attention": {"rope_type": "default", "rope_theta": theta, **rope},
            "sliding_attention": {"rope_type": "default", "rope_theta": local}}
    elif rope:
        fields["rope_parameters"] = rope
    if key == "phi3" and (original := _field(reader, "phi3.rope.scaling.original_context_length")):
        fields["original_max_position_embeddings"] = original  # Phi-3 keeps it top-level
    return {"model_type": model_type, "architectures": [FAMILIES[model_type].architecture],
            **fields, "dtype": "float32"}


# general.sampling.* fields (what convert_hf_to_gguf.py keeps of generation_config.json)
_SAMPLING = {"temp": "temperature", "top_k": "top_k", "top_p": "top_p", "min_p": "min_p",
             "penalty_repeat": "repetition_penalty"}


def generation_config(reader) -> dict:
    """generation_config.json for the GGUF: every token llama.cpp ends a generation at (the
    file's EOS, EOT and EOM ids, and the tokens named as turn ends) as `eos_token_id`, EOS
    first, and the sampling defaults the file carries (general.sampling.*)."""
    from tidal.model.generation_config import END_TOKEN_NAMES

    ends = [_field(reader, f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    if tokens is not None:  # each entry's text, without decoding the ~100k of them all
        ends += [i for i, part in enumerate(tokens.data)
                 if bytes(tokens.parts[part]).decode("utf-8", "replace") in END_TOKEN_NAMES]
    config: dict[str, Any] = {"eos_token_id": list(dict.fromkeys(
        int(i) for i in ends if i is not None))}
    for key, name in _SAMPLING.items():
        if (value := _field(reader, f"general.sampling.{key}")) is not None:
            config[name] = value
    return config


def _hf_names(arch: str, num_layers: int) -> dict[str, str]:
    """GGUF tensor name (without .weight/.bias) -> Hugging Face name, for `arch`."""
    import gguf

    arch_id = next(a for a, name in gguf.MODEL_ARCH_NAMES.items() if name == arch)
    kinds = gguf.MODEL_TENSORS[arch_id]
    # Phi-3 has no separate gate: its ffn_up is HF's fused gate_up_proj.
    fused = gguf.MODEL_TENSOR.FFN_GATE not in kinds and gguf.MODEL_TENSOR.FFN_UP in kinds
    tensor_map = gguf.get_tensor_name_map(arch_id, num_layers)
    names = {}
    for pattern in _HF_NAMES:
        if pattern.endswith(".mlp.up_proj" if fused else ".mlp.gate_up_proj"):
            continue
        for bid in range(num_layers) if "{bid}" in pattern else (0,):
            hf_name = pattern.format(bid=bid)
            if (gguf_name := tensor_map.get_name(hf_name)) is not None:
                names[gguf_name] = hf_name
    return names


class HFTensor(NamedTuple):
    """One GGUF tensor under its Hugging Face name, with what llama.cpp changed in it."""

    tensor: Any  # gguf's ReaderTensor: shape, type and the bytes (a view of the file)
    name: str  # HF name with .weight/.bias; an experts' tensor keeps ".experts." stacked
    heads: int | None  # llama q/k: its rows are permuted over this many heads
    norm_offset: bool  # a Gemma norm, stored as 1 + w


def hf_layout(reader, config: dict) -> list[HFTensor]:
    """Every GGUF tensor to load, under its Hugging Face name (RoPE frequency tensors are
    left out: hf_config reads them). ValueError for a tensor with no Hugging Face name."""
    arch = _field(reader, "general.architecture")
    names = _hf_names(arch, config["num_hidden_layers"])
    out = []
    for t in reader.tensors:
        base, _, suffix = t.name.rpartition(".")
        if base.startswith("rope_"):  # RoPE frequency tensors: read into rope_parameters
            continue
        if (hf_name := names.get(base)) is None:
            raise ValueError(f"{arch} GGUF tensor {t.name!r} has no Hugging Face name")
        heads = None
        if arch == "llama" and base.endswith(".attn_q"):
            heads = config["num_attention_heads"]
        elif arch == "llama" and base.endswith(".attn_k"):
            heads = config["num_key_value_heads"]
        # llama.cpp stores Gemma's w with the 1 that HF's x * (1 + w) adds
        gemma_norm = arch.startswith("gemma") and base.endswith("norm")
        out.append(HFTensor(t, f"{hf_name}.{suffix}", heads, gemma_norm))
    return out


def expert_name(name: str, expert: int) -> str:
    """The HF name of one expert's slice of a stacked [experts, out, in] tensor."""
    return name.replace(".experts.", f".experts.{expert}.")


def is_flat_gate(name: str, ndim: int) -> bool:
    """A shared_expert_gate stored flat: HF's is a Linear(hidden, 1), [1, hidden]."""
    return ".shared_expert_gate." in name and ndim == 1


def hf_tensors(reader, config: dict) -> dict[str, np.ndarray]:
    """The GGUF's tensors dequantized to float32 under Hugging Face checkpoint names, undoing
    what llama.cpp's converter changed (q/k row order, Gemma's norm offset, stacked experts)."""
    from gguf.quants import dequantize

    out = {}
    for t, name, heads, norm_offset in hf_layout(reader, config):
        w = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
        if heads is not None:
            w = _unpermute(w, heads)
        if norm_offset:
            w = w - 1
        if is_flat_gate(name, w.ndim):
            w = w[None]
        if ".experts." in name:  # [experts, out, in] -> HF checkpoints' one per expert
            for e in range(w.shape[0]):
                out[expert_name(name, e)] = np.ascontiguousarray(w[e])
        else:
            out[name] = np.ascontiguousarray(w)
    return out


def convert_gguf(gguf_path: str | os.PathLike, out_dir: str | os.PathLike,
                 weights: bool = True) -> Path:
    """Write `gguf_path`'s config.json, generation_config.json and tokenizer into `out_dir`,
    and with `weights` its float32 safetensors too (written atomically: a half-written cache
    is never left behind). Returns `out_dir`. ValueError for a GGUF that does not convert (or is truncated)."""
    from tidal.model.gguf_file import open_gguf

    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    reader = open_gguf(gguf_path)
    config = hf_config(reader)
    hf_layout(reader, config)  # an architecture or tensor that does not convert fails first
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out_dir.name + ".", dir=out_dir.parent))
    try:
        if weights:
            write_weights(reader, config, tmp / "model.safetensors")
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        (tmp / "generation_config.json").write_text(
            json.dumps(generation_config(reader), indent=2))
        save_tokenizer(reader, gguf_path, tmp)
        if (out_dir / "config.json").is_file():  # another process converted it meanwhile:
            shutil.rmtree(tmp)  # keep theirs, which a server may be reading already
            return out_dir
        if out_dir.exists():  # a folder left half-written
            shutil.rmtree(out_dir)
        tmp.rename(out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def save_tokenizer(reader, gguf_path: Path, out_dir: Path) -> None:
    """The file's tokenizer as transformers builds it from a GGUF (tokenizer.json,
    tokenizer_config.json, the chat template) into `out_dir`: transformers' GGUF tokenizer
    builder over the metadata `reader` read (its own GGUF reader imports torch, a second
    of a first start, and reads the file once more)."""
    try:
        from transformers.integrations.gguf import GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:  # a transformers without them: the public way
        from transformers import AutoTokenizer

        from tidal.model.gguf_file import lent_to_gguf

        with lent_to_gguf():
            tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent),
                                                      gguf_file=gguf_path.name)
    else:
        fields, config = ({name: value for key, name in renames.items()
                           if (value := _field(reader, f"tokenizer.{key}")) is not None}
                          for renames in (GGUF_TOKENIZER_MAPPING["tokenizer"],
                                          GGUF_TOKENIZER_MAPPING["tokenizer_config"]))
        if fields.get("tokenizer_type") == "llama":  # llama.cpp's default for sentencepiece
            config.setdefault("add_bos_token", True)
        for special in ("bos", "eos", "unk", "pad"):
            token_id = fields.get(f"{special}_token_id")
            config[f"{special}_token"] = None if token_id is None else fields["tokens"][token_id]
        backend, extra = convert_gguf_tokenizer(_field(reader, "general.architecture"), fields)
        tokenizer = TokenizersBackend(tokenizer_object=backend, **config, **extra)
    tokenizer.save_pretrained(str(out_dir))


def write_weights(reader, config: dict, path: Path) -> None:
    """The file's tensors dequantized to float32 safetensors at `path`, written atomically."""
    from safetensors.numpy import save_file

    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    try:
        save_file(hf_tensors(reader, config), str(tmp))
        tmp.rename(path)
    finally:
        tmp.unlink(missing_ok=True)
