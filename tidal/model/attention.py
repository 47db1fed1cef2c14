"""Attention over the paged KV cache.

`AttentionMetadata` describes one flattened step (no padding between sequences): prefill
sequences, each a contiguous run of query tokens, followed by decode sequences of one token
each. A backend writes the step's K/V into the cache through `slot_mapping` and reads a
sequence's context through its block table. `TorchAttention` runs on CPU and GPU with plain
PyTorch ops; faster GPU kernels can implement the same interface.

Cache layout, per layer and for K and V alike: [num_kv_heads, num_blocks, block_size,
head_dim]. Head-major, so gathering a batch's blocks yields [Hkv, B, L, D] whose (Hkv, B)
dims fold into one matmul batch with no copy, and GQA needs no repeated KV heads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F


class PrefillSeq(NamedTuple):
    """One prefill sequence of a step: its query run and, when a prefix is already cached,
    the block table to read it from and the [len, cached + len] causal mask."""

    start: int
    length: int
    cached: int
    table: torch.Tensor | None = None
    mask: torch.Tensor | None = None


@dataclass
class AttentionMetadata:
    """Where each token of a flattened step goes and what it may attend to."""

    slot_mapping: torch.Tensor  # [T] cache slot (block_id * block_size + offset) per token
    prefills: list[PrefillSeq]  # first in the batch, one contiguous run each
    num_prefill_tokens: int
    # Decode sequences follow: one query token each (None when the step has none).
    decode_block_tables: torch.Tensor | None = None  # [B, max_blocks], padded with 0
    decode_bias: torch.Tensor | None = None  # [1, B, 1, max_blocks * block_size] 0 or -inf
    decode_max_len: int = 0  # the longest decode context, this step's token included


def kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int,
                   head_dim: int) -> tuple[int, int, int, int]:
    return (num_kv_heads, num_blocks, block_size, head_dim)


class AttentionBackend:
    """The interface a model layer calls: write this step's K/V, attend, return [T, H, D]."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        raise NotImplementedError


class TorchAttention(AttentionBackend):
    """Prefill: one causal SDPA per sequence (over cache + new tokens when a prefix is
    cached). Decode: one batched matmul-softmax-matmul over the gathered blocks with a
    length bias (a single sequence takes SDPA over its exact context instead)."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = head_dim ** -0.5
        self.groups = num_heads // num_kv_heads

    def forward(self, q, k, v, k_cache, v_cache, meta):
        # q: [T, H, D]; k, v: [T, Hkv, D]; caches: [Hkv, num_blocks, block_size, D]
        hkv, d = self.num_kv_heads, self.head_dim
        k_cache.view(hkv, -1, d).index_copy_(1, meta.slot_mapping, k.transpose(0, 1))
        v_cache.view(hkv, -1, d).index_copy_(1, meta.slot_mapping, v.transpose(0, 1))
        if not meta.prefills:  # a decode-only step: no runs to stitch together
            return self._decode(q, k_cache, v_cache, meta)
        out = torch.empty_like(q)
        for seq in meta.prefills:
            end = seq.start + seq.length
            qs = q[seq.start:end].transpose(0, 1).unsqueeze(0)  # [1, H, L, D]
            if seq.cached == 0:
                ks, vs = k[seq.start:end].transpose(0, 1), v[seq.start:end].transpose(0, 1)
            else:
                ks = self._gather(k_cache, seq.table)[:, :seq.cached + seq.length]
                vs = self._gather(v_cache, seq.table)[:, :seq.cached + seq.length]
            o = F.scaled_dot_product_attention(
                qs, ks.unsqueeze(0), vs.unsqueeze(0), attn_mask=seq.mask,
                is_causal=seq.cached == 0, scale=self.scale, enable_gqa=True)
            out[seq.start:end] = o.squeeze(0).transpose(0, 1)
        if meta.decode_block_tables is not None:
            out[meta.num_prefill_tokens:] = self._decode(q[meta.num_prefill_tokens:],
                                                         k_cache, v_cache, meta)
        return out

    @staticmethod
    def _gather(cache: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        """[Hkv, len(table) * block_size, D]: one sequence's context in order."""
        return cache.index_select(1, table).flatten(1, 2)

    def _decode(self, q, k_cache, v_cache, meta) -> torch.Tensor:
        tables = meta.decode_block_tables
        b, nb = tables.shape
        hkv, d = self.num_kv_heads, self.head_dim
        if b == 1:  # no padding to mask: SDPA over the exact context
            n = meta.decode_max_len
            ks = self._gather(k_cache, tables[0])[:, :n].unsqueeze(0)
            vs = self._gather(v_cache, tables[0])[:, :n].unsqueeze(0)
            o = F.scaled_dot_product_attention(q.unsqueeze(2), ks, vs, scale=self.scale,
                                               enable_gqa=True)
            return o.squeeze(2)
        flat = tables.view(-1)
        ks = k_cache.index_select(1, flat).view(hkv, b, -1, d)  # [Hkv, B, L, D]
        vs = v_cache.index_select(1, flat).view(hkv, b, -1, d)
        qg = q.reshape(b, hkv, self.groups, d).transpose(0, 1)  # [Hkv, B, G, D]
        scores = torch.matmul(qg, ks.transpose(-1, -2)).float() * self.scale + meta.decode_bias
        probs = torch.softmax(scores, dim=-1).to(q.dtype)
        return torch.matmul(probs, vs).transpose(0, 1).reshape(b, self.num_heads, d)
