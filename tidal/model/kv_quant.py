"""The KV cache's element format: the model's dtype, bfloat16 under a float32 model
(`--kv-cache-dtype bfloat16`: half the bytes, each value rounded to nearest even as torch
rounds it; `auto` for own formats on AMX and AVX512-BF16 CPUs,
tidal.engine.device.pick_kv_cache_dtype), float32
(a float32 model's own, where `auto` is bf16), or 8-bit codes with a scale per token and KV
head (`--kv-cache-dtype int8|fp8_e4m3`).

A quantized cache row (one token's one KV head) is `head_dim` one-byte codes followed by the
row's scale as a float16 count of 2^-8 units: x ~= code * scale, scale = max|x| / the code's
largest value (127, or 448 for e4m3), rounded to that grid. Two bytes, not a float32's four:
the pool holds 1.94x bf16's tokens at head_dim 64 instead of 1.88x. Codes are taken against
the rounded scale, so a value still decodes within half a step of itself; a row's largest
value may clamp, by at most 127 x 2^-11 of a step. The 2^-8 unit moves float16's normal range
down to where K and V live (rows of max|x| from ~3e-5 to ~32,000 for int8; past it the scale
saturates). A scale per row, not per block: each write is then independent of what the block
already holds (no block is re-quantized when a larger value arrives), as llama.cpp's q8_0 KV
scales each 32 values. The scale sits inside the row, so every byte copy of blocks
(copy-on-write, P/D transfer, the disk tier, speculation's slot moves) moves codes and scales
together, and a cache is still one tensor per layer for K and one for V.

The C++ kernels (paged_attention.cpp) read and write the same rows bit for bit: codes are
round-half-even of x / scale in float32 (int8) or c10's e4m3 rounding of it, clamped.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tidal.model.config import KV_SCALE_BYTES

SCALE_BYTES = KV_SCALE_BYTES  # the float16 scale after each row's codes
SCALE_STEPS = 256.0  # the stored float16 counts the scale in steps of 1 / SCALE_STEPS
SCALE_MAX = 65504.0  # float16's largest finite value: larger scales saturate
CODES = {"int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn}  # the formats' code dtypes
# formats of values without a scale (float32: a float32 model's own, where `auto` is bf16)
FLOATS = {"bfloat16": torch.bfloat16, "float32": torch.float32}


@dataclass(frozen=True)
class KVFormat:
    """How a KV cache stores each token's K and V heads: `name` is 'auto' (the model's
    dtype, no scale), a key of FLOATS (that dtype, no scale) or of CODES (the engine
    config's --kv-cache-dtype)."""

    name: str = "auto"

    def __post_init__(self) -> None:
        if self.name != "auto" and self.name not in CODES and self.name not in FLOATS:
            raise ValueError("kv_cache_dtype must be auto or one of "
                             f"{', '.join([*FLOATS, *CODES])}; got {self.name!r}")

    @property
    def quantized(self) -> bool:
        """Whether rows are codes with a scale."""
        return self.name in CODES

    @property
    def qmax(self) -> float:
        """The largest code's magnitude."""
        return 127.0 if self.name == "int8" else 448.0

    def storage(self, dtype: torch.dtype) -> torch.dtype:
        """The cache tensor's dtype for a model computing in `dtype`."""
        return CODES.get(self.name) or FLOATS.get(self.name, dtype)

    def row_width(self, head_dim: int) -> int:
        """Elements of one (token, KV head) row in the cache tensor."""
        return head_dim + SCALE_BYTES if self.quantized else head_dim

    def bytes_per_token(self, arch, dtype: torch.dtype) -> int:
        """A token's K and V over every layer, in bytes."""
        return arch.kv_bytes_per_token(self.storage(dtype).itemsize,
                                       SCALE_BYTES if self.quantized else 0)

    def cache_shape(self, num_blocks: int, block_size: int, num_kv_heads: int,
                    head_dim: int) -> tuple[int, int, int, int]:
        return (num_blocks, block_size, num_kv_heads, self.row_width(head_dim))

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """Rows [..., d] of any float dtype as quantized rows [..., d + 2] of bytes."""
        x = x.float()
        amax = x.abs().amax(dim=-1, keepdim=True)
        stored = (amax / self.qmax * SCALE_STEPS).clamp_(max=SCALE_MAX).to(torch.float16)
        scale = stored.float() / SCALE_STEPS  # exact: a power of two
        codes = (x / torch.where(scale > 0, scale, torch.ones_like(scale))).clamp_(
            -self.qmax, self.qmax)
        codes = codes.round_().to(torch.int8) if self.name == "int8" else codes.to(
            torch.float8_e4m3fn)
        return torch.cat([codes.view(torch.uint8), stored.view(torch.uint8)], dim=-1)

    def decode(self, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Cache rows [..., width] as values [..., d] in `dtype`."""
        if not self.quantized:
            return rows.to(dtype)
        raw = rows.view(torch.uint8)
        d = raw.shape[-1] - SCALE_BYTES
        codes = raw[..., :d].view(self.storage(dtype))
        scale = raw[..., d:].contiguous().view(torch.float16).float().div_(SCALE_STEPS)
        if self.name == "int8":  # one pass: int8 times float32 promotes in the kernel
            return torch.mul(codes, scale).to(dtype)
        return codes.float().mul_(scale).to(dtype)  # torch promotes no float8

    def write(self, cache: torch.Tensor, slots: torch.Tensor, x: torch.Tensor) -> None:
        """Write rows x [T, Hkv, d] at `slots` of `cache` [blocks, block_size, Hkv, width]."""
        if not self.quantized:
            cache.view(-1, *x.shape[1:]).index_copy_(0, slots, x.to(cache.dtype))
            return
        flat = cache.view(torch.uint8).view(-1, x.shape[1], cache.shape[-1])
        flat.index_copy_(0, slots, self.encode(x))


AUTO = KVFormat()
