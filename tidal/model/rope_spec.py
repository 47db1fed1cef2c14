"""Which RoPE schedule a Hugging Face `config.json` asks for, as a pure-Python `RopeSpec`
(`tidal.model.rope` turns it into tables). Read with transformers' precedence rules."""

from __future__ import annotations

from dataclasses import dataclass

# The schedules tidal computes; transformers also has proportional and mrope ones.
ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3", "longrope")


class RopeConfigError(ValueError):
    """A RoPE setting tidal does not run; the message says which."""


def partial_rotary(cfg: dict) -> float:
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
    attention_factor: float | None = None  # yarn, longrope: scales cos and sin; None derives it
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    mscale: float = 0.0  # yarn (DeepSeek style attention factor when both are set)
    mscale_all_dim: float = 0.0  # yarn
    truncate: bool = True  # yarn: round the correction range outwards
    short_factor: tuple[float, ...] = ()  # longrope: per-frequency divisors within original
    long_factor: tuple[float, ...] = ()  # longrope: the divisors past the original context

    @classmethod
    def from_config(cls, cfg: dict, head_dim: int, model_type: str = "") -> "RopeSpec":
        """The spec of a config.json, as transformers' `standardize_rope_params` reads it:
        `rope_scaling` wins over `rope_parameters`, top-level `rope_theta` and
        `partial_rotary_factor` fill what the dict lacks."""
        rope = dict(cfg.get("rope_scaling") or cfg.get("rope_parameters") or {})
        if any(isinstance(v, dict) for v in rope.values()):
            raise RopeConfigError("per-layer RoPE parameters (one dict per layer type) are "
                                  "not supported")
        kind = rope.get("rope_type", rope.get("type")) or "default"
        if model_type == "phi3" and kind in ("su", "yarn"):  # Phi3Config's legacy names
            kind = "longrope"
        if kind not in ROPE_TYPES:
            raise RopeConfigError(f"RoPE type {kind!r} is not supported (tidal runs "
                                  f"{', '.join(ROPE_TYPES)})")
        theta = rope.get("rope_theta") or cfg.get("rope_theta") or 10000.0
        partial = partial_rotary(cfg)
        max_pos = cfg.get("max_position_embeddings") or 2048
        # transformers gives a top-level original_max_position_embeddings priority (Phi-3).
        original = (cfg.get("original_max_position_embeddings")
                    or rope.get("original_max_position_embeddings") or max_pos)
        factor = rope.get("factor")
        if factor is None:  # yarn and longrope derive it (DeepSeek-V3, Phi-3); others need it
            if kind in ("yarn", "longrope"):
                factor = max_pos / original
            elif kind != "default":
                raise RopeConfigError(f"RoPE type {kind!r} needs a 'factor'")
        if kind == "llama3" and not {"low_freq_factor", "high_freq_factor"} <= rope.keys():
            raise RopeConfigError("RoPE type 'llama3' needs low_freq_factor and high_freq_factor")
        short, long = rope.get("short_factor") or (), rope.get("long_factor") or ()
        rotary_dim = int(head_dim * partial)
        if kind == "longrope" and not len(short) == len(long) == rotary_dim // 2:
            raise RopeConfigError(f"RoPE type 'longrope' needs short_factor and long_factor "
                                  f"of {rotary_dim // 2} values each")
        return cls(
            kind=kind, theta=float(theta), rotary_dim=rotary_dim,
            max_position_embeddings=max_pos, factor=float(factor or 1.0),
            original_max_position_embeddings=int(original),
            low_freq_factor=float(rope.get("low_freq_factor", 1.0)),
            high_freq_factor=float(rope.get("high_freq_factor", 4.0)),
            attention_factor=rope.get("attention_factor"),
            beta_fast=float(rope.get("beta_fast") or 32),
            beta_slow=float(rope.get("beta_slow") or 1),
            mscale=float(rope.get("mscale") or 0),
            mscale_all_dim=float(rope.get("mscale_all_dim") or 0),
            truncate=bool(rope.get("truncate", True)),
            short_factor=tuple(map(float, short)), long_factor=tuple(map(float, long)))

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
