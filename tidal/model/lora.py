"""LoRA adapters from PEFT folders (adapter_config.json + adapter_model.safetensors), fused
onto tidal's projections.

tidal fuses q/k/v into one `qkv_proj` and gate/up into one `gate_up_proj`, so an adapter's
pieces are kept per part of those projections: the slot pool (lora_slots.py) stacks the A
matrices of q, k and v and sets their B matrices block-diagonally, so x A^T B^T is each
piece's delta in its own columns. A Phi-3 adapter of the fused `qkv_proj` or `gate_up_proj`
becomes one piece per part, each with the whole A and its part of B. Each piece's scale
(lora_alpha / r, or / sqrt(r) with rsLoRA; r is the module's own, alpha is alpha_pattern's
where it names the module) is folded into its B. What tidal cannot serve is refused by
name: DoRA, adapters on the embeddings or the LM head, on routed experts, trained biases,
modules saved whole.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tidal.model.config import ModelArch

# PEFT's module name -> (tidal's projection, which of its parts; None: all of it)
PIECES = {"q_proj": ("qkv", 0), "k_proj": ("qkv", 1), "v_proj": ("qkv", 2),
          "qkv_proj": ("qkv", None), "o_proj": ("o", 0),
          "gate_proj": ("gate_up", 0), "up_proj": ("gate_up", 1),
          "gate_up_proj": ("gate_up", None), "down_proj": ("down", 0)}
PROJECTIONS = ("qkv", "o", "gate_up", "down")  # a decoder layer's, in order
REFUSED = {"embed_tokens": "the embeddings", "lm_head": "the LM head",
           "experts": "routed MoE experts", "w1": "routed MoE experts",
           "w2": "routed MoE experts", "w3": "routed MoE experts"}
_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.\w+)?\.weight$")


class LoRAError(ValueError):
    """An adapter tidal cannot serve; the message names the adapter and why."""


def projection_shapes(arch: ModelArch) -> dict[str, tuple[int, list[int]]]:
    """Each projection's in_features and its parts' out_features."""
    h, kv, d = arch.num_heads, arch.num_kv_heads, arch.head_dim
    inter = arch.intermediate_size
    return {"qkv": (arch.hidden_size, [h * d, kv * d, kv * d]),
            "o": (h * d, [arch.hidden_size]),
            "gate_up": (arch.hidden_size, [inter, inter]),
            "down": (inter, [arch.hidden_size])}


@dataclass
class LoRAAdapter:
    """One adapter: (layer, projection) -> its pieces, (part of the fused projection, A
    [r, in], B [part's out, r] with the scale folded in), float32 on CPU. `rank` is its
    largest piece's rank."""

    name: str
    path: str
    rank: int
    weights: dict[tuple[int, str], list[tuple[int, torch.Tensor, torch.Tensor]]] = field(
        repr=False)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for pieces in self.weights.values()
                   for _, a, b in pieces)


def _pattern(patterns: dict, module: str, default):
    """PEFT's rank_pattern / alpha_pattern lookup: the first key the module's name ends with
    (a key may be a regex)."""
    for key, value in (patterns or {}).items():
        try:
            hit = re.match(rf"(.*\.)?({key})$", module)
        except re.error:  # not a regex: the name itself
            hit = module == key or module.endswith("." + key)
        if hit:
            return value
    return default


def read_config(name: str, folder: Path) -> dict:
    """adapter_config.json, with what tidal does not serve refused by name."""
    path = folder / "adapter_config.json"
    if not path.is_file():
        raise LoRAError(f"LoRA adapter {name!r}: {folder} holds no adapter_config.json "
                        "(a PEFT adapter folder)")
    try:
        cfg = json.loads(path.read_text())
    except ValueError as e:
        raise LoRAError(f"LoRA adapter {name!r}: adapter_config.json is not JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise LoRAError(f"LoRA adapter {name!r}: adapter_config.json is not a JSON object")
    refusals = [
        (cfg.get("peft_type", "LORA") != "LORA", f"peft_type {cfg.get('peft_type')!r} is not LORA"),
        (cfg.get("use_dora"), "DoRA adapters (use_dora) are not supported"),
        (cfg.get("bias", "none") != "none" or cfg.get("lora_bias"),
         "adapters that train biases are not supported"),
        (cfg.get("modules_to_save"), f"modules saved whole ({cfg.get('modules_to_save')}) "
                                     "are not supported"),
        (cfg.get("fan_in_fan_out"), "fan_in_fan_out (Conv1D) adapters are not supported"),
        (cfg.get("trainable_token_indices"), "trainable token embeddings are not supported"),
        (cfg.get("target_parameters"), "adapters on parameters (MoE experts) are not supported"),
        (cfg.get("use_qalora") or cfg.get("alora_invocation_tokens") or cfg.get("use_bdlora"),
         "QA-LoRA, aLoRA and BD-LoRA adapters are not supported"),
        (cfg.get("layer_replication"), "layer replication is not supported"),
    ]
    for refused, why in refusals:
        if refused:
            raise LoRAError(f"LoRA adapter {name!r}: {why}")
    targets = cfg.get("target_modules") or []
    for target in [targets] if isinstance(targets, str) else targets:
        for module, what in REFUSED.items():
            if target == module or target.endswith("." + module):
                raise LoRAError(f"LoRA adapter {name!r}: adapters on {what} ({target}) are "
                                "not supported")
    return cfg


def load_adapter(name: str, path: str | Path, arch: ModelArch, max_rank: int) -> LoRAAdapter:
    """The adapter in PEFT folder `path`, fused for `arch`; LoRAError naming what is wrong
    (a missing or bad file, a module or shape that does not fit, a rank over `max_rank`)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    folder = Path(path)
    if not folder.is_dir():
        raise LoRAError(f"LoRA adapter {name!r}: {folder} is not a folder")
    cfg = read_config(name, folder)
    file = folder / "adapter_model.safetensors"
    if not file.is_file():
        raise LoRAError(f"LoRA adapter {name!r}: {folder} holds no adapter_model.safetensors"
                        + (" (only .bin: convert it to safetensors)"
                           if (folder / "adapter_model.bin").exists() else ""))
    try:
        tensors = load_file(str(file))
    except (SafetensorError, OSError) as e:
        raise LoRAError(f"LoRA adapter {name!r}: adapter_model.safetensors: {e}") from None
    pieces: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        m = _KEY.search(key)
        module = key.rsplit(".lora_", 1)[0]
        if m is None or m.group(2) not in PIECES:
            what = next((w for mod, w in REFUSED.items() if f".{mod}." in f".{key}"), None)
            why = f"adapters on {what}" if what else "this module"
            raise LoRAError(f"LoRA adapter {name!r}: {key}: {why} is not supported (tidal "
                            f"adapts {', '.join(PIECES)})")
        layer = int(m.group(1))
        if layer >= arch.num_layers:
            raise LoRAError(f"LoRA adapter {name!r}: {key}: the model has {arch.num_layers} layers")
        if arch.moe and arch.moe.layers[layer] and PIECES[m.group(2)][0] in ("gate_up", "down"):
            raise LoRAError(f"LoRA adapter {name!r}: {key}: layer {layer}'s MLP is routed "
                            "experts; adapters on routed MoE experts are not supported")
        pieces.setdefault((layer, module), {"piece": m.group(2)})[m.group(3)] = t.float()
    shapes = projection_shapes(arch)
    fused: dict[tuple[int, str], list] = {}
    top = 0
    for (layer, module), p in sorted(pieces.items(), key=lambda kv: kv[0]):
        if "A" not in p or "B" not in p:
            raise LoRAError(f"LoRA adapter {name!r}: {module} has lora_A or lora_B alone")
        a, b = p["A"], p["B"]
        proj, part = PIECES[p["piece"]]
        k, outs = shapes[proj]
        out = sum(outs) if part is None else outs[part]
        r = a.shape[0]
        if a.dim() != 2 or b.dim() != 2 or a.shape[1] != k or b.shape != (out, r):
            raise LoRAError(f"LoRA adapter {name!r}: {module}: lora_A {tuple(a.shape)} and "
                            f"lora_B {tuple(b.shape)} do not fit the model's [{out}, {k}] "
                            "(an adapter of another base model?)")
        if r > max_rank:
            raise LoRAError(f"LoRA adapter {name!r}: rank {r} ({module}) is over "
                            f"max_lora_rank={max_rank}")
        top = max(top, r)
        # r is this module's rank (rank_pattern's, if it names the module)
        alpha = _pattern(cfg.get("alpha_pattern"), module, cfg.get("lora_alpha", r))
        scale = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
        if proj in ("o", "down"):  # Granite's multiplier, folded as into the base weights
            scale *= arch.residual_multiplier
        b = b * scale
        # a fused checkpoint's piece (Phi-3's qkv_proj) is one piece per part sharing its A
        split = (list(enumerate(b.split(outs))) if part is None else [(part, b)])
        held = fused.setdefault((layer, proj), {})
        for p_index, pb in split:
            if p_index in held:
                raise LoRAError(f"LoRA adapter {name!r}: layer {layer} adapts {proj}'s part "
                                f"{p_index} twice ({module})")
            held[p_index] = (a.contiguous(), pb.contiguous())
    if not fused:
        raise LoRAError(f"LoRA adapter {name!r}: adapter_model.safetensors holds no LoRA weights")
    weights = {key: [(p, a, b) for p, (a, b) in sorted(parts.items())]
               for key, parts in fused.items()}
    return LoRAAdapter(name, str(folder), top, weights)
