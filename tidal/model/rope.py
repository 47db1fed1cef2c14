"""Rotary position embeddings: the frequency schedules of Hugging Face configs.

`RopeSpec` (tidal.model.rope_spec, pure Python) says which schedule a config asks for;
`rope_tables` turns it into the float32 cos / signed-sin tables the model and the C++
decoder index by position. Each schedule repeats transformers' float32 arithmetic step for
step, so the tables equal HF's rotary modules' (tested).
"""

from __future__ import annotations

import math

import torch

from tidal.model.rope_spec import RopeSpec


def _exponents(dim: int) -> torch.Tensor:
    return torch.arange(0, dim, 2, dtype=torch.int64).float() / dim


def inverse_frequencies(spec: RopeSpec) -> tuple[torch.Tensor, float]:
    """(inv_freq [rotary_dim / 2], attention factor) of a static schedule; `dynamic` returns
    its schedule within max_position_embeddings (the default one)."""
    dim, base = spec.rotary_dim, spec.theta
    inv = 1.0 / (base ** _exponents(dim))
    if spec.kind in ("default", "dynamic"):
        return inv, 1.0
    if spec.kind == "linear":
        return inv / spec.factor, 1.0
    if spec.kind == "llama3":
        return _llama3(spec, inv), 1.0
    if spec.kind == "longrope":
        return _longrope_inverse(spec, spec.short_factor), _longrope_attention(spec)
    return _yarn(spec)


def _longrope_inverse(spec: RopeSpec, factors: tuple[float, ...]) -> torch.Tensor:
    return 1.0 / (torch.tensor(factors, dtype=torch.float32)
                  * spec.theta ** _exponents(spec.rotary_dim))


def _longrope_attention(spec: RopeSpec) -> float:
    """LongRoPE's cos/sin scale: sqrt(1 + log(factor) / log(original context))."""
    if spec.attention_factor is not None:
        return float(spec.attention_factor)
    if spec.factor <= 1.0:
        return 1.0
    return math.sqrt(1 + math.log(spec.factor) / math.log(spec.original_max_position_embeddings))


def _llama3(spec: RopeSpec, inv: torch.Tensor) -> torch.Tensor:
    """Llama 3.1: long wavelengths divided by `factor`, short ones kept, a linear blend
    between; the operations in transformers' order (its float32 rounding)."""
    old, factor = spec.original_max_position_embeddings, spec.factor
    low, high = spec.low_freq_factor, spec.high_freq_factor
    low_wavelen, high_wavelen = old / low, old / high
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (old / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, blended, scaled)


def _yarn(spec: RopeSpec) -> tuple[torch.Tensor, float]:
    """YaRN: interpolate the long wavelengths by `factor`, extrapolate the short ones, a
    linear ramp between the dims whose rotations over the original context are beta_fast
    and beta_slow; cos and sin scaled by the attention factor."""
    dim, base, factor = spec.rotary_dim, spec.theta, spec.factor
    original = spec.original_max_position_embeddings

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = spec.attention_factor
    if attention is None:
        attention = (float(mscale(factor, spec.mscale) / mscale(factor, spec.mscale_all_dim))
                     if spec.mscale and spec.mscale_all_dim else mscale(factor))

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(spec.beta_fast), correction_dim(spec.beta_slow)
    if spec.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - ramp  # 1: extrapolate (high frequencies), 0: interpolate
    return interpolation * (1 - keep) + extrapolation * keep, float(attention)


def _dynamic_frequencies(spec: RopeSpec, num_positions: int) -> torch.Tensor:
    """[P, rotary_dim / 2]: the token at position p uses the NTK base transformers computes
    for a sequence of max(p + 1, max_position_embeddings) tokens: what HF applies when it
    decodes token by token with its cache, and independent of batching and chunking."""
    dim, max_pos = spec.rotary_dim, spec.max_position_embeddings
    inv = inverse_frequencies(spec)[0].expand(num_positions, -1).clone()
    if num_positions > max_pos:
        # transformers does this in float32 tensors (seq_len is a tensor there).
        seq_len = torch.arange(max_pos + 1, num_positions + 1, dtype=torch.int64)
        base = spec.theta * ((spec.factor * seq_len / max_pos) - (spec.factor - 1)) ** (
            dim / (dim - 2))
        inv[max_pos:] = 1.0 / (base[:, None] ** _exponents(dim)[None, :])
    return inv


def rope_tables(spec: RopeSpec, num_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 cos and signed sin, [P, rotary_dim]: x*cos + roll(x, rotary_dim/2)*sin is
    HF's x*cos + rotate_half(x)*sin on the rotated dims."""
    positions = torch.arange(num_positions, dtype=torch.float32)
    if spec.kind == "dynamic":
        freqs, attention = positions[:, None] * _dynamic_frequencies(spec, num_positions), 1.0
    elif spec.kind == "longrope":
        # Position p uses the factors transformers picks for a sequence of p + 1 tokens (as
        # for dynamic): short within the original context, long past it.
        inv, attention = inverse_frequencies(spec)
        freqs = positions[:, None] * inv[None, :]
        past = spec.original_max_position_embeddings
        if num_positions > past:
            long = _longrope_inverse(spec, spec.long_factor)
            freqs[past:] = positions[past:, None] * long[None, :]
    else:
        inv, attention = inverse_frequencies(spec)
        freqs = positions[:, None] * inv[None, :]
    cos, sin = freqs.cos(), freqs.sin()
    if attention != 1.0:
        cos, sin = cos * attention, sin * attention
    return torch.cat([cos, cos], dim=-1), torch.cat([-sin, sin], dim=-1)
