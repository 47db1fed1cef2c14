"""The architecture of a Llama-family model, read from a Hugging Face `config.json`.

`ModelArch.from_dict` is the one gate for what tidal runs: anything it cannot run (another
architecture, a RoPE schedule, experts, quantized checkpoints, ...) raises
`UnsupportedModelError` naming the architecture and every missing piece, before any weight
or KV memory is taken.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

# The schedules tidal computes; transformers also has longrope, proportional and mrope ones.
ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3")


class RopeConfigError(ValueError):
    """A RoPE setting tidal does not run; the message says which."""


def _partial_rotary(cfg: dict) -> float:
    rope = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    return rope.get("partial_rotary_factor") or cfg.get("partial_rotary_factor") or 1.0


@dataclass(frozen=True)
class RopeSpec:
    """One RoPE schedule: its kind, base, how many head dims it rotates, and the scaling
    constants of that kind (unused ones keep their defaults)."""

    kind: str = "default"
    theta: float = 10000.0
    rotary_dim: int = 0  # the first rotary_dim dims of each head rotate; 0: the whole head
    max_position_embeddings: int = 2048
    factor: float = 1.0
    original_max_position_embeddings: int = 0  # llama3 and yarn: the pre-training context
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    attention_factor: float | None = None  # yarn: scales cos and sin; None derives it
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    mscale: float = 0.0  # yarn (DeepSeek style attention factor when both are set)
    mscale_all_dim: float = 0.0  # yarn
    truncate: bool = True  # yarn: round the correction range outwards

    @classmethod
    def from_config(cls, cfg: dict, head_dim: int) -> "RopeSpec":
        """The spec of a config.json, as transformers' `standardize_rope_params` reads it:
        `rope_scaling` wins over `rope_parameters`, top-level `rope_theta` and
        `partial_rotary_factor` fill what the dict lacks."""
        rope = dict(cfg.get("rope_scaling") or cfg.get("rope_parameters") or {})
        if any(isinstance(v, dict) for v in rope.values()):
            raise RopeConfigError("per-layer RoPE parameters (one dict per layer type) are "
                                  "not supported")
        kind = rope.get("rope_type", rope.get("type")) or "default"
        if kind not in ROPE_TYPES:
            raise RopeConfigError(f"RoPE type {kind!r} is not supported (tidal runs "
                                  f"{', '.join(ROPE_TYPES)})")
        theta = rope.get("rope_theta") or cfg.get("rope_theta") or 10000.0
        partial = _partial_rotary(cfg)
        max_pos = cfg.get("max_position_embeddings") or 2048
        # transformers gives a top-level original_max_position_embeddings priority (Phi-3).
        original = (cfg.get("original_max_position_embeddings")
                    or rope.get("original_max_position_embeddings") or max_pos)
        factor = rope.get("factor")
        if factor is None:  # yarn derives it (DeepSeek-V3); the others require it
            if kind == "yarn":
                factor = max_pos / original
            elif kind != "default":
                raise RopeConfigError(f"RoPE type {kind!r} needs a 'factor'")
        if kind == "llama3" and not {"low_freq_factor", "high_freq_factor"} <= rope.keys():
            raise RopeConfigError("RoPE type 'llama3' needs low_freq_factor and high_freq_factor")
        return cls(
            kind=kind, theta=float(theta), rotary_dim=int(head_dim * partial),
            max_position_embeddings=max_pos, factor=float(factor or 1.0),
            original_max_position_embeddings=int(original),
            low_freq_factor=float(rope.get("low_freq_factor", 1.0)),
            high_freq_factor=float(rope.get("high_freq_factor", 4.0)),
            attention_factor=rope.get("attention_factor"),
            beta_fast=float(rope.get("beta_fast") or 32),
            beta_slow=float(rope.get("beta_slow") or 1),
            mscale=float(rope.get("mscale") or 0),
            mscale_all_dim=float(rope.get("mscale_all_dim") or 0),
            truncate=bool(rope.get("truncate", True)))

    @property
    def context_length(self) -> int:
        """The longest sequence the schedule is meant for: linear and dynamic stretch
        max_position_embeddings by `factor`, yarn the original context (as vLLM derives it);
        llama3 configs state the stretched length already."""
        if self.kind in ("linear", "dynamic"):
            return int(self.max_position_embeddings * self.factor)
        if self.kind == "yarn":
            return max(self.max_position_embeddings,
                       int(self.original_max_position_embeddings * self.factor))
        return self.max_position_embeddings


@dataclass(frozen=True)
class Family:
    """How one transformers architecture differs from Llama, all of it shape-level."""

    architecture: str  # the *ForCausalLM class
    qkv_bias: bool | None  # q/k/v carry a bias; None: the config's attention_bias (o too)
    qk_norm: bool = False  # per-head RMSNorm on q and k (Qwen3)
    windows: str = "none"  # "all": sliding_window on every layer; "layer_types": per layer
    partial_rotary: bool = False  # whether its HF model honours partial_rotary_factor
    mlp_bias: bool = False  # whether its HF model reads mlp_bias (others ignore it)
    rms_norm_eps: float = 1e-6  # the config class's default


FAMILIES = {
    "llama": Family("LlamaForCausalLM", None, mlp_bias=True),
    "mistral": Family("MistralForCausalLM", False, windows="all"),
    "qwen2": Family("Qwen2ForCausalLM", True, windows="layer_types"),
    "qwen3": Family("Qwen3ForCausalLM", None, qk_norm=True, windows="layer_types"),
    "phi3": Family("Phi3ForCausalLM", False, windows="all", partial_rotary=True,
                   rms_norm_eps=1e-5),
}
# Config fields of mixture-of-experts models (Mixtral, Qwen2/3-MoE, DeepSeek, GLM-4.5).
_MOE_FIELDS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_intermediate_size",
               "n_shared_experts", "num_experts_per_tok")


class UnsupportedModelError(ValueError):
    """A config.json tidal cannot run; the message names the architecture and what is
    missing."""


def _problems(cfg: dict, model_type: str) -> list[str]:
    """Everything about `cfg` that tidal cannot run (empty when it can)."""
    moe = [k for k in _MOE_FIELDS if cfg.get(k)]
    moe = [f"mixture-of-experts layers ({', '.join(moe)}) are not supported yet"] if moe else []
    if model_type not in FAMILIES:
        return [f"model_type {model_type!r} is not supported (tidal runs "
                f"{', '.join(f.architecture for f in FAMILIES.values())})"] + moe
    family, out = FAMILIES[model_type], moe
    wrong = [a for a in cfg.get("architectures") or [] if a != family.architecture]
    if wrong:
        out.append(f"architecture {wrong[0]} is not supported for model_type {model_type!r} "
                   f"(tidal runs {family.architecture})")
    if cfg.get("quantization_config"):
        method = cfg["quantization_config"].get("quant_method", "?")
        out.append(f"quantized checkpoints ({method}) are not supported: tidal loads dense "
                   "safetensors (its own --quantization works on those)")
    act = cfg.get("hidden_act", cfg.get("hidden_activation", "silu"))
    if act != "silu":
        out.append(f"hidden_act {act!r} is not supported (tidal's MLP is SiLU-gated)")
    layer_types = cfg.get("layer_types") or []
    types = set(layer_types) - {"full_attention", "sliding_attention"}
    if types:
        out.append(f"layer types {sorted(types)} are not supported")
    if layer_types and len(layer_types) != cfg.get("num_hidden_layers"):
        out.append(f"{len(layer_types)} layer_types for {cfg.get('num_hidden_layers')} layers")
    rope = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    partial = _partial_rotary(cfg)
    if partial != 1.0 and not family.partial_rotary:
        out.append(f"partial_rotary_factor={partial}: transformers' {family.architecture} "
                   "rotates whole heads and ignores it; tidal refuses rather than guess")
    kind = rope.get("rope_type", rope.get("type"))
    if model_type == "phi3" and kind in ("su", "yarn", "longrope"):
        out.append(f"RoPE type {kind!r} is not supported yet (Phi-3 reads it as longrope)")
    else:
        try:
            RopeSpec.from_config(cfg, _head_dim(cfg))
        except RopeConfigError as exc:
            out.append(str(exc))
    return out


def _head_dim(cfg: dict) -> int:
    return cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]


def _windows(cfg: dict, family: Family, num_layers: int) -> tuple[int, ...]:
    """Each layer's sliding window (0: full attention), as transformers assigns them."""
    if family.windows == "none":
        return (0,) * num_layers
    window = cfg.get("sliding_window") or 0
    if family.windows == "all":
        return (window,) * num_layers
    # Qwen2/3: a window only with use_sliding_window, on the layers typed sliding (by
    # default those from max_window_layers on).
    if not cfg.get("use_sliding_window"):
        return (0,) * num_layers
    start = cfg.get("max_window_layers", 28)
    types = cfg.get("layer_types") or ["sliding_attention" if i >= start else "full_attention"
                                       for i in range(num_layers)]
    return tuple(window if t == "sliding_attention" else 0 for t in types)


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
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None = None
    rope: RopeSpec = RopeSpec()
    o_bias: bool = False  # o_proj carries a bias (Llama / Qwen3 with attention_bias)
    mlp_bias: bool = False  # gate/up and down carry biases (Llama with mlp_bias)
    layer_windows: tuple[int, ...] = ()  # per layer: attend to the last N positions; 0: all

    def __post_init__(self) -> None:
        if not self.rope.rotary_dim:  # built without a config: plain RoPE over whole heads
            object.__setattr__(self, "rope", replace(
                self.rope, rotary_dim=self.head_dim,
                max_position_embeddings=self.max_position_embeddings))

    @classmethod
    def from_dict(cls, cfg: dict, name: str = "this model") -> "ModelArch":
        model_type = cfg.get("model_type", "llama")
        known = FAMILIES[model_type].architecture if model_type in FAMILIES else model_type
        arch_name = (cfg.get("architectures") or [known])[0]
        try:
            problems = _problems(cfg, model_type)
            if not problems:
                return cls._build(cfg, model_type)
        except KeyError as exc:
            problems = [f"config.json lacks {exc.args[0]!r}"]
        raise UnsupportedModelError(f"tidal cannot run {name} ({arch_name}): "
                                    + "; ".join(problems))

    @classmethod
    def _build(cls, cfg: dict, model_type: str) -> "ModelArch":
        family = FAMILIES[model_type]
        heads, layers = cfg["num_attention_heads"], cfg["num_hidden_layers"]
        head_dim = _head_dim(cfg)
        attention_bias = bool(cfg.get("attention_bias", False))
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        rope = RopeSpec.from_config(cfg, head_dim)
        return cls(
            model_type=model_type,
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            vocab_size=cfg["vocab_size"],
            rms_norm_eps=cfg.get("rms_norm_eps", family.rms_norm_eps),
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            qkv_bias=attention_bias if family.qkv_bias is None else family.qkv_bias,
            qk_norm=family.qk_norm,
            eos_token_ids=eos_ids,
            bos_token_id=cfg.get("bos_token_id"),
            rope=rope,
            o_bias=attention_bias and family.qkv_bias is None,
            mlp_bias=bool(cfg.get("mlp_bias")) and family.mlp_bias,
            layer_windows=_windows(cfg, family, layers),
        )

    @classmethod
    def from_folder(cls, folder: str | Path) -> "ModelArch":
        path = Path(folder) / "config.json"
        return cls.from_dict(json.loads(path.read_text()), name=str(folder))

    @property
    def context_length(self) -> int:
        """The longest sequence this model serves: max_position_embeddings, stretched by
        the RoPE scaling where its config states the original length."""
        return self.rope.context_length

    @property
    def windows(self) -> tuple[int, ...]:
        """Each layer's sliding window, 0 for full attention."""
        return self.layer_windows or (0,) * self.num_layers

    def kv_bytes_per_token(self, itemsize: int) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * itemsize
