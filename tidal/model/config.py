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

from tidal.model.rope_spec import RopeConfigError, RopeSpec, partial_rotary

QUANT_METHODS = ("gptq", "awq")  # quantized checkpoints tidal loads (4-bit, groups of 32-128)

@dataclass(frozen=True)
class Family:
    """How one transformers architecture differs from Llama, all of it shape-level."""

    architecture: str  # the *ForCausalLM class
    # q/k/v carry a bias: True/False; None: the config's attention_bias (o too); a string:
    # that config field (default true), q/k/v only (Qwen2-MoE's qkv_bias)
    qkv_bias: bool | str | None
    qk_norm: bool = False  # per-head RMSNorm on q and k (Qwen3, Gemma 3)
    # "all": sliding_window on every layer; "flag": every layer when use_sliding_window;
    # "layer_types": the layers typed sliding when use_sliding_window; "typed": always typed
    windows: str = "none"
    partial_rotary: bool = False  # whether its HF model honours partial_rotary_factor
    mlp_bias: bool = False  # whether its HF model reads mlp_bias (others ignore it)
    rms_norm_eps: float = 1e-6  # the config class's default
    # routed experts: "mixtral" (top-k weights renormalised), "qwen" (when norm_topk_prob)
    experts: str = ""
    shared_expert: bool = False  # a sigmoid-gated shared expert beside the routed ones
    gemma: bool = False  # Gemma's (1 + w) norms, scaled embedding, norms around each block
    window_pattern: int = 0  # Gemma: every Nth layer global when a config lacks layer_types
    multipliers: bool = False  # Granite's scalars on embeddings, residuals, scores, logits
    nope: bool = False  # SmolLM3: layers without RoPE (no_rope_layers), windowed if any


FAMILIES = {
    "llama": Family("LlamaForCausalLM", None, mlp_bias=True),
    "mistral": Family("MistralForCausalLM", False, windows="all"),
    "qwen2": Family("Qwen2ForCausalLM", True, windows="layer_types"),
    "qwen3": Family("Qwen3ForCausalLM", None, qk_norm=True, windows="layer_types"),
    "phi3": Family("Phi3ForCausalLM", False, windows="all", partial_rotary=True,
                   rms_norm_eps=1e-5),
    "mixtral": Family("MixtralForCausalLM", False, windows="all", rms_norm_eps=1e-5,
                      experts="mixtral"),
    "qwen2_moe": Family("Qwen2MoeForCausalLM", "qkv_bias", windows="layer_types",
                        experts="qwen", shared_expert=True),
    "qwen3_moe": Family("Qwen3MoeForCausalLM", None, qk_norm=True, windows="flag",
                        experts="qwen"),
    "gemma2": Family("Gemma2ForCausalLM", None, windows="typed", gemma=True,
                     window_pattern=2),
    "gemma3_text": Family("Gemma3ForCausalLM", None, qk_norm=True, windows="typed",
                          gemma=True, window_pattern=6),
    "granite": Family("GraniteForCausalLM", None, mlp_bias=True, multipliers=True),
    "smollm3": Family("SmolLM3ForCausalLM", None, mlp_bias=True, windows="layer_types",
                      nope=True),
}
# Config fields of mixture-of-experts models (Mixtral, Qwen2/3-MoE, DeepSeek, GLM-4.5).
_MOE_FIELDS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_intermediate_size",
               "n_shared_experts", "num_experts_per_tok")
# Gated-MLP activations (transformers' ACT2FN names) the layers compute.
ACTIVATIONS = ("silu", "gelu_pytorch_tanh", "gelu")


@dataclass(frozen=True)
class MoESpec:
    """Routed experts of a mixture-of-experts model: each token's `top_k` experts by the
    router's softmax, their outputs summed with those weights (renormalised to 1 when
    `renormalize`); `shared_intermediate_size` > 0 adds a sigmoid-gated shared expert."""

    num_experts: int
    top_k: int
    intermediate_size: int  # of one expert
    renormalize: bool
    layers: tuple[bool, ...]  # per layer: experts (True) or the dense MLP (False)
    shared_intermediate_size: int = 0
    held_experts: int = 0  # expert parallelism: the experts one rank holds (0: all)

    @property
    def held(self) -> int:
        """The routed experts this model's blocks hold and run."""
        return self.held_experts or self.num_experts


class UnsupportedModelError(ValueError):
    """A config.json tidal cannot run; the message names the architecture and what is
    missing."""


def _problems(cfg: dict, model_type: str) -> list[str]:
    """Everything about `cfg` that tidal cannot run (empty when it can)."""
    family = FAMILIES.get(model_type)
    moe = [k for k in _MOE_FIELDS if cfg.get(k)]
    moe = ([f"mixture-of-experts layers ({', '.join(moe)}) are not supported for this family"]
           if moe and not (family and family.experts) else [])
    if family is None:
        hint = (" (Gemma 3 runs as its text-only Gemma3ForCausalLM, model_type 'gemma3_text')"
                if model_type == "gemma3" else "")
        return [f"model_type {model_type!r} is not supported{hint} (tidal runs "
                f"{', '.join(f.architecture for f in FAMILIES.values())})"] + moe
    out = moe
    body = family.architecture.replace("ForCausalLM", "Model")  # an embedding model's
    scorer = family.architecture.replace("ForCausalLM", "ForSequenceClassification")
    wrong = [a for a in cfg.get("architectures") or []
             if a not in (family.architecture, body, scorer)]
    if wrong:
        out.append(f"architecture {wrong[0]} is not supported for model_type {model_type!r} "
                   f"(tidal runs {family.architecture})")
    if cfg.get("quantization_config"):
        out += _quantization_problems(cfg["quantization_config"])
        if family.multipliers:  # they fold into dense weights only (loader.fold_multipliers)
            out.append(f"quantized {family.architecture} checkpoints are not supported")
    act = _activation(cfg, family)
    if act not in ACTIVATIONS:
        out.append(f"hidden_act {act!r} is not supported (tidal's gated MLP runs "
                   f"{', '.join(ACTIVATIONS)})")
    if family.experts and not cfg.get("num_experts_per_tok"):
        out.append("num_experts_per_tok is missing")
    layer_types = cfg.get("layer_types") or []
    types = set(layer_types) - {"full_attention", "sliding_attention"}
    if types:
        out.append(f"layer types {sorted(types)} are not supported")
    if layer_types and len(layer_types) != cfg.get("num_hidden_layers"):
        out.append(f"{len(layer_types)} layer_types for {cfg.get('num_hidden_layers')} layers")
    partial = partial_rotary(cfg)
    if partial != 1.0 and not family.partial_rotary:
        out.append(f"partial_rotary_factor={partial}: transformers' {family.architecture} "
                   "rotates whole heads and ignores it; tidal refuses rather than guess")
    try:
        _ropes(cfg, model_type, _head_dim(cfg))
        _rope_layers(cfg, family, cfg.get("num_hidden_layers", 0))
    except RopeConfigError as exc:
        out.append(str(exc))
    return out


def _activation(cfg: dict, family: Family) -> str:
    # Gemma's MLP reads hidden_activation; the others hidden_act.
    if family.gemma:
        return cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
    return cfg.get("hidden_act", "silu")


def _head_dim(cfg: dict) -> int:
    return cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]


def _ropes(cfg: dict, model_type: str, head_dim: int) -> tuple[RopeSpec, RopeSpec | None]:
    """(the global layers' RoPE, the sliding layers' when it differs). Gemma 3 keeps one
    schedule per layer type: `rope_parameters` keyed by type, or (older configs) rope_theta
    and rope_scaling for global layers and rope_local_base_freq for sliding ones."""
    if model_type != "gemma3_text":
        return RopeSpec.from_config(cfg, head_dim, model_type), None
    params = cfg.get("rope_parameters") or {}
    if isinstance(params.get("full_attention"), dict):
        per_type = {t: {**cfg, "rope_scaling": None, "rope_parameters": params.get(t)}
                    for t in ("full_attention", "sliding_attention")}
    else:
        local = {"rope_type": "default", "rope_theta": cfg.get("rope_local_base_freq", 1e4)}
        per_type = {"full_attention": cfg,
                    "sliding_attention": {**cfg, "rope_scaling": None, "rope_parameters": local}}
    return (RopeSpec.from_config(per_type["full_attention"], head_dim, model_type),
            RopeSpec.from_config(per_type["sliding_attention"], head_dim, model_type))


def _rope_layers(cfg: dict, family: Family, num_layers: int) -> tuple[bool, ...]:
    """Per layer, whether it rotates q and k (SmolLM3: no_rope_layers' 1s; by default
    every `no_rope_layer_interval`th layer does not); () where every layer does."""
    if not family.nope:
        return ()
    interval = cfg.get("no_rope_layer_interval", 4)
    if not isinstance(interval, int) or interval < 1:
        raise RopeConfigError(f"no_rope_layer_interval must be a positive integer, got "
                              f"{interval!r}")
    flags = cfg.get("no_rope_layers") or [int((i + 1) % interval != 0)
                                          for i in range(num_layers)]
    if len(flags) != num_layers:
        raise RopeConfigError(f"{len(flags)} no_rope_layers for {num_layers} layers")
    return tuple(bool(f) for f in flags)


def _layer_types(cfg: dict, family: Family, num_layers: int) -> list[str]:
    if cfg.get("layer_types"):
        return cfg["layer_types"]
    if family.nope:  # SmolLM3's sliding layers are its layers without RoPE
        return ["full_attention" if rope else "sliding_attention"
                for rope in _rope_layers(cfg, family, num_layers)]
    if family.window_pattern:
        pattern = (cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern")
                   or family.window_pattern)
        return ["sliding_attention" if (i + 1) % pattern else "full_attention"
                for i in range(num_layers)]
    # Qwen2/3: by default the layers from max_window_layers on.
    start = cfg.get("max_window_layers", 28)
    return ["sliding_attention" if i >= start else "full_attention" for i in range(num_layers)]


def _windows(cfg: dict, family: Family, num_layers: int) -> tuple[int, ...]:
    """Each layer's sliding window (0: full attention), as transformers assigns them."""
    window = cfg.get("sliding_window") or 0
    if family.windows in ("none", "all", "flag"):
        on = family.windows == "all" or (family.windows == "flag"
                                         and cfg.get("use_sliding_window"))
        return (window if on else 0,) * num_layers
    if family.windows == "layer_types" and not cfg.get("use_sliding_window"):
        return (0,) * num_layers
    types = _layer_types(cfg, family, num_layers)
    return tuple(window if t == "sliding_attention" else 0 for t in types)


def _moe(cfg: dict, family: Family, num_layers: int) -> MoESpec | None:
    # Checkpoints say num_experts (Qwen) or num_local_experts (Mixtral, transformers 5).
    experts = cfg.get("num_local_experts") or cfg.get("num_experts")
    if not family.experts or not experts:
        return None
    skip, step = set(cfg.get("mlp_only_layers") or ()), cfg.get("decoder_sparse_step") or 1
    return MoESpec(
        num_experts=experts, top_k=cfg["num_experts_per_tok"],
        # Mixtral's experts are intermediate_size wide; Qwen's moe_intermediate_size.
        intermediate_size=cfg.get("moe_intermediate_size") or cfg["intermediate_size"],
        renormalize=family.experts == "mixtral" or bool(cfg.get("norm_topk_prob")),
        layers=tuple(i not in skip and (i + 1) % step == 0 for i in range(num_layers)),
        shared_intermediate_size=(cfg.get("shared_expert_intermediate_size") or 0)
        if family.shared_expert else 0)


def _quantization_problems(quantization_config: dict) -> list[str]:
    """What tidal cannot load in a checkpoint's `quantization_config` (empty: it can)."""
    q = quantization_config
    method = str(q.get("quant_method", "?")).lower()
    if method not in QUANT_METHODS:
        return [f"quantized checkpoints ({method}) are not supported: tidal loads GPTQ and AWQ "
                "4-bit checkpoints, and dense safetensors (its own --quantization works on "
                "those)"]
    out = []
    bits = q.get("bits", q.get("w_bit"))
    group = q.get("group_size", q.get("q_group_size"))
    if bits != 4:
        out.append(f"{method} with {bits} bits is not supported (tidal loads 4-bit {method})")
    if group not in (32, 64, 128):
        out.append(f"{method} group_size {group} is not supported (32, 64 or 128)")
    if method == "awq" and str(q.get("version", "gemm")).lower() != "gemm":
        out.append(f"awq version {q.get('version')!r} is not supported (tidal loads GEMM)")
    if method == "gptq" and q.get("checkpoint_format", "gptq") not in ("gptq", "gptq_v2"):
        out.append(f"gptq checkpoint_format {q.get('checkpoint_format')!r} is not supported")
    return out


@dataclass(frozen=True)
class ModelArch:
    """Shapes and constants of a decoder-only transformer of the Llama family and its
    relatives (Mistral, Qwen, Phi-3, Gemma 2/3, Granite, SmolLM3, Mixtral and Qwen-MoE)."""

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
    hidden_act: str = "silu"  # the gated MLP's activation (an ACTIVATIONS name)
    moe: MoESpec | None = None  # routed experts in place of the MLP on some layers
    local_rope: RopeSpec | None = None  # sliding layers' RoPE where it differs (Gemma 3)
    rope_layers: tuple[bool, ...] = ()  # per layer: rotates q and k (SmolLM3); (): all do
    gemma: bool = False  # (1 + w) norms in float32, embedding * sqrt(hidden), sandwich norms
    attn_scale: float = 0.0  # query scale; 0: head_dim ** -0.5
    attn_softcap: float = 0.0  # scores -> cap * tanh(scores / cap) before the mask; 0: none
    final_softcap: float = 0.0  # the same on the logits
    # Granite's: the embeddings times this, each residual branch's output times this, the
    # logits over this; the loader folds them into the weights (loader.fold_multipliers)
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0
    quant_method: str = ""  # a quantized checkpoint's format ('gptq', 'awq'); '': dense

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
        rope, local_rope = _ropes(cfg, model_type, head_dim)
        qkv_bias = (cfg.get(family.qkv_bias, True) if isinstance(family.qkv_bias, str)
                    else attention_bias if family.qkv_bias is None else family.qkv_bias)
        gemma2 = model_type == "gemma2"  # transformers' defaults where a config omits them
        scalar = cfg.get("query_pre_attn_scalar", 256) if family.gemma else 0
        scalars = cfg if family.multipliers else {}  # Granite's; its config defaults them to 1
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
            tie_word_embeddings=cfg.get("tie_word_embeddings", family.gemma),
            qkv_bias=bool(qkv_bias),
            qk_norm=family.qk_norm,
            eos_token_ids=eos_ids,
            bos_token_id=cfg.get("bos_token_id"),
            rope=rope,
            o_bias=attention_bias and family.qkv_bias is None,
            mlp_bias=bool(cfg.get("mlp_bias")) and family.mlp_bias,
            layer_windows=_windows(cfg, family, layers),
            hidden_act=_activation(cfg, family),
            moe=_moe(cfg, family, layers),
            local_rope=local_rope,
            rope_layers=_rope_layers(cfg, family, layers),
            gemma=family.gemma,
            attn_scale=(scalar ** -0.5 if scalar else
                        float(scalars.get("attention_multiplier", 1.0)) if scalars else 0.0),
            attn_softcap=float(cfg.get("attn_logit_softcapping", 50.0 if gemma2 else None)
                               or 0.0),
            final_softcap=float(cfg.get("final_logit_softcapping", 30.0 if gemma2 else None)
                                or 0.0),
            quant_method=str((cfg.get("quantization_config") or {}).get("quant_method", ""))
            .lower(),
            embedding_multiplier=float(scalars.get("embedding_multiplier", 1.0)),
            residual_multiplier=float(scalars.get("residual_multiplier", 1.0)),
            logits_scaling=float(scalars.get("logits_scaling", 1.0)),
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
    def head_fold(self) -> float:
        """What the loader folds into the final norm (loader.fold_multipliers): 1 /
        logits_scaling, and 1 / embedding_multiplier where the head is the tied
        embeddings; 1 but for Granite."""
        tied = self.embedding_multiplier if self.tie_word_embeddings else 1.0
        return 1.0 / (self.logits_scaling * tied)

    @property
    def windows(self) -> tuple[int, ...]:
        """Each layer's sliding window, 0 for full attention."""
        return self.layer_windows or (0,) * self.num_layers

    def layer_rope(self, layer: int) -> RopeSpec:
        """The RoPE schedule of one layer (sliding layers may keep their own)."""
        return self.local_rope if self.local_rope and self.windows[layer] else self.rope

    def kv_bytes_per_token(self, itemsize: int, scale_bytes: int = 0) -> int:
        """A token's K and V over every layer: `itemsize` bytes a value, plus `scale_bytes`
        a row (a quantized row's scale, tidal.model.kv_quant)."""
        return 2 * self.num_layers * self.num_kv_heads * (self.head_dim * itemsize
                                                          + scale_bytes)


KV_SCALE_BYTES = 2  # a quantized KV row's float16 scale, after its codes (kv_quant.py)
TP_FLAG = "--tensor-parallel-size"
EP_FLAG = "--enable-expert-parallel"
PP_FLAG = "--pipeline-parallel-size"


def check_shardable(arch: ModelArch, size: int, expert_parallel: bool = False) -> None:
    """ValueError naming the flag where `arch` does not split over `size` ranks (with
    `expert_parallel`, its routed experts whole, E/size a rank)."""
    if size == 1:
        return
    counts = [("attention heads", arch.num_heads),
              ("MLP intermediate size", arch.intermediate_size)]
    moe = arch.moe
    if moe is not None:
        counts += ([(f"routed experts ({EP_FLAG})", moe.num_experts)] if expert_parallel
                   else [(f"expert intermediate size (or split the experts whole: "
                          f"{EP_FLAG})", moe.intermediate_size)])
        counts += [("shared expert intermediate size", moe.shared_intermediate_size)]
    for what, count in counts:
        if count % size:
            raise ValueError(f"{TP_FLAG} {size} does not divide the model's {count} {what}")
    kv = arch.num_kv_heads  # fewer than the ranks: each is replicated on size / kv ranks
    if (kv % size) if kv >= size else (size % kv):
        raise ValueError(f"{TP_FLAG} {size} neither divides the model's {kv} key/value heads "
                         f"nor is a multiple of them")


def kv_heads_held(rank: int, size: int, num_kv_heads: int) -> tuple[int, int]:
    """(first, count) of the KV heads tensor-parallel rank `rank` of `size` holds: its
    share, or one head replicated on size / num_kv_heads ranks where there are fewer."""
    return rank * num_kv_heads // size, max(1, num_kv_heads // size)


def shard_arch(arch: ModelArch, size: int, expert_parallel: bool = False) -> ModelArch:
    """The shapes one rank of `size` computes with: its heads (one key/value head where
    the model has fewer than ranks) and intermediate rows; routed experts' rows too, or
    with `expert_parallel` 1/size of the experts whole."""
    moe = arch.moe
    if moe is not None:
        moe = replace(moe, shared_intermediate_size=moe.shared_intermediate_size // size,
                      **({"held_experts": moe.num_experts // size} if expert_parallel else
                         {"intermediate_size": moe.intermediate_size // size}))
    return replace(arch, num_heads=arch.num_heads // size,
                   num_kv_heads=kv_heads_held(0, size, arch.num_kv_heads)[1],
                   intermediate_size=arch.intermediate_size // size, moe=moe)


def part_arch(arch: ModelArch, size: int, expert_parallel: bool = False) -> ModelArch:
    """The shapes one rank of `size` builds: shard_arch's, with its rows of the embedding
    and the LM head (the vocabulary split, rounded up; its logits are gathered whole)."""
    return replace(shard_arch(arch, size, expert_parallel),
                   vocab_size=-(-arch.vocab_size // size))


def stage_layers(num_layers: int, stages: int, stage: int) -> range:
    """The contiguous layers pipeline stage `stage` of `stages` holds (the first stages
    one more where they do not divide)."""
    if not 1 <= stages <= num_layers:
        raise ValueError(f"{PP_FLAG} {stages} must be in 1..{num_layers}, the model's layers")
    per, extra = divmod(num_layers, stages)
    start = stage * per + min(stage, extra)
    return range(start, start + per + (stage < extra))


def stage_arch(arch: ModelArch, layers: range) -> ModelArch:
    """The shapes of a pipeline stage that holds `layers` of the model, numbered from 0."""
    moe = arch.moe and replace(arch.moe, layers=arch.moe.layers[layers.start:layers.stop])
    return replace(arch, num_layers=len(layers), moe=moe,
                   layer_windows=arch.windows[layers.start:layers.stop],
                   rope_layers=arch.rope_layers[layers.start:layers.stop])
