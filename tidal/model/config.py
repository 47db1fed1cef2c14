"""The architecture of a Llama-family model, read from a Hugging Face `config.json`."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

# model_type -> (q/k/v projections carry a bias, per-head RMSNorm on q and k)
FAMILIES = {
    "llama": (False, False),
    "mistral": (False, False),
    "qwen2": (True, False),
    "qwen3": (False, True),
}


@dataclass(frozen=True)
class ModelArch:
    """Shapes and constants of a decoder-only Llama-family transformer."""

    model_type: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None = None

    @classmethod
    def from_dict(cls, cfg: dict) -> "ModelArch":
        model_type = cfg.get("model_type", "llama")
        if model_type not in FAMILIES:
            raise ValueError(f"model_type {model_type!r} is not supported; tidal runs "
                             f"{', '.join(FAMILIES)}")
        # transformers 5 writes RoPE settings under rope_parameters; older configs use
        # rope_theta and rope_scaling.
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind not in ("default", None):
            raise ValueError(f"RoPE type {kind!r} is not supported yet")
        if cfg.get("use_sliding_window"):
            raise ValueError("sliding-window attention is not supported yet")
        qkv_bias, qk_norm = FAMILIES[model_type]
        heads = cfg["num_attention_heads"]
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        return cls(
            model_type=model_type,
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            vocab_size=cfg["vocab_size"],
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=rope.get("rope_theta", cfg.get("rope_theta", 10000.0)),
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            qkv_bias=cfg.get("attention_bias", qkv_bias),
            qk_norm=qk_norm,
            eos_token_ids=eos_ids,
            bos_token_id=cfg.get("bos_token_id"),
        )

    @classmethod
    def from_folder(cls, folder: str | Path) -> "ModelArch":
        return cls.from_dict(json.loads((Path(folder) / "config.json").read_text()))

    def kv_bytes_per_token(self, itemsize: int) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * itemsize
