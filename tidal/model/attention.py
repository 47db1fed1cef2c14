"""Attention over the paged KV cache.

`AttentionMetadata` describes one flattened step (no padding between sequences): prefill
sequences, each a contiguous run of query tokens, followed by decode sequences of one token
each. A backend writes the step's K/V into the cache through `slot_mapping` and reads a
sequence's context through its block table. `TorchAttention` runs on CPU and GPU with
PyTorch's scaled_dot_product_attention; faster GPU kernels can implement the same interface.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class AttentionMetadata:
    """Where each token of a flattened step goes and what it may attend to."""

    slot_mapping: torch.Tensor  # [T] cache slot (block_id * block_size + offset) per token
    # Prefill sequences come first, one entry each: (query start, query length, tokens
    # already cached before this step, block table as a tensor).
    prefills: list[tuple[int, int, int, torch.Tensor]]
    num_prefill_tokens: int
    # Decode sequences follow: one query token each (None when the step has none).
    decode_block_tables: torch.Tensor | None = None  # [B, max_blocks], padded with 0
    decode_context_lens: torch.Tensor | None = None  # [B] tokens to attend, this one included
    decode_mask: torch.Tensor | None = None  # [B, 1, 1, max_blocks * block_size] True = keep


class AttentionBackend:
    """The interface a model layer calls: write this step's K/V, attend, return [T, H*D]."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        raise NotImplementedError


class TorchAttention(AttentionBackend):
    """Prefill: one causal SDPA per sequence (over cache + new tokens when a prefix is
    cached). Decode: one batched SDPA over the gathered block tables with a length mask."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = head_dim ** -0.5
        self.groups = num_heads // num_kv_heads

    def forward(self, q, k, v, k_cache, v_cache, meta):
        # q: [T, H, D]; k, v: [T, Hkv, D]; caches: [num_blocks, block_size, Hkv, D]
        bs = k_cache.shape[1]
        flat_k = k_cache.view(-1, self.num_kv_heads, self.head_dim)
        flat_v = v_cache.view(-1, self.num_kv_heads, self.head_dim)
        flat_k.index_copy_(0, meta.slot_mapping, k)
        flat_v.index_copy_(0, meta.slot_mapping, v)
        out = torch.empty_like(q)
        for start, length, cached, table in meta.prefills:
            qs = q[start:start + length].transpose(0, 1).unsqueeze(0)  # [1, H, L, D]
            if cached == 0:
                ks, vs = k[start:start + length], v[start:start + length]
                mask, causal = None, True
            else:
                total = cached + length
                ks = k_cache[table].flatten(0, 1)[:total]
                vs = v_cache[table].flatten(0, 1)[:total]
                pos = torch.arange(cached, total, device=q.device)
                mask = torch.arange(total, device=q.device)[None, :] <= pos[:, None]
                causal = False
            o = F.scaled_dot_product_attention(
                qs, self._heads(ks), self._heads(vs), attn_mask=mask, is_causal=causal,
                scale=self.scale)
            out[start:start + length] = o.squeeze(0).transpose(0, 1)
        if meta.decode_block_tables is not None:
            n = meta.num_prefill_tokens
            tables = meta.decode_block_tables
            b, nb = tables.shape
            ks = k_cache[tables].view(b, nb * bs, self.num_kv_heads, self.head_dim)
            vs = v_cache[tables].view(b, nb * bs, self.num_kv_heads, self.head_dim)
            qs = q[n:].unsqueeze(2)  # [B, H, 1, D]
            o = F.scaled_dot_product_attention(
                qs, self._heads(ks, batched=True), self._heads(vs, batched=True),
                attn_mask=meta.decode_mask, scale=self.scale)
            out[n:] = o.squeeze(2)
        return out

    def _heads(self, x: torch.Tensor, batched: bool = False) -> torch.Tensor:
        """[.., L, Hkv, D] -> [.., H, L, D], repeating KV heads for grouped-query attention."""
        x = x.transpose(-3, -2)
        if self.groups > 1:
            x = x.repeat_interleave(self.groups, dim=-3)
        return x if batched else x.unsqueeze(0)
