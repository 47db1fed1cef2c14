"""Attention over the paged KV cache.

`AttentionMetadata` describes one flattened step (no padding between sequences): prefill
sequences, each a contiguous run of query tokens, followed by decode sequences of one token
each. A backend writes the step's K/V into the cache through `slot_mapping` and reads a
sequence's context through its block table. `TorchAttention` runs on CPU and GPU with plain
PyTorch ops, decodes through a paged kernel where one is given (C++ on CPU, Triton on CUDA).

Cache layout, per layer and for K and V alike: [num_blocks, block_size, num_kv_heads,
head_dim]. Block-major: a block is one contiguous run of bytes (what a KV transfer sends), and
gathering a batch's blocks yields [B, L * Hkv, D] rows that one batched matmul reads as is.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.nn.functional as F

from tidal.model.kv_quant import AUTO, KVFormat
from tidal.model.linear import cpu_flags

log = logging.getLogger("tidal.model")

# A float32 model's prompt run whose attention takes at least this many scores a head (its
# tokens times its context: a fresh run of 256 tokens, 32 after 2,016 cached) over a bf16 KV
# cache attends in bf16: K and V as the cache holds them, the queries rounded alike. bf16
# attention ran 2.5x float32's from 256 x 256 to 976 x 2,000 on AMX; smaller runs, where it
# gains little, keep float32. So do such runs over a quantized cache (int8, fp8: coarser
# than bf16) on CPUs with AMX (BF16_OVER_CODES): 8 fresh 2,000-token prompts over int8 KV
# took 10.0 s in float32 against 5.9-6.2 s over bf16 KV.
BF16_ATTENTION_SCORES = 256 * 256
BF16_OVER_CODES = "amx_bf16" in cpu_flags()


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
    decode_bias: torch.Tensor | None = None  # from the backend's decode_bias(); None at B=1
    decode_max_len: int = 0  # the longest decode context, this step's token included
    decode_lens: torch.Tensor | None = None  # [B] each decode's context, its token included
    # [B, 2] int64 where a speculation tree verifies (None: no tree): each decode row's
    # (start, bits): of the positions from start on it sees only those whose bit is set.
    decode_tree: torch.Tensor | None = None
    # Sliding-window masks built by the backend, shared by the step's layers of one window.
    window_masks: dict = field(default_factory=dict)
    # For a paged prefill kernel (else None): the prefills' block tables [S, max_blocks]
    # padded with the null block, query starts [S + 1], context lengths with the new tokens
    # [S], and the longest query run (host-side: it sizes the kernel's grid).
    prefill_tables: torch.Tensor | None = None
    query_starts: torch.Tensor | None = None
    prefill_lens: torch.Tensor | None = None
    max_query_len: int = 0
    # Batch-invariant decodes through the prefill kernel: each row a run of its own, the
    # run starts [B + 1] (made by the backend once a step).
    decode_starts: torch.Tensor | None = None


def prefix_causal_mask(cached: int, length: int, device) -> torch.Tensor:
    """[length, cached + length], True where a query may look: a chunk after `cached`
    tokens sees them all, and its own tokens causally."""
    return (torch.arange(cached + length, device=device)[None, :]
            <= torch.arange(cached, cached + length, device=device)[:, None])


def kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int,
                   head_dim: int) -> tuple[int, int, int, int]:
    return AUTO.cache_shape(num_blocks, block_size, num_kv_heads, head_dim)


class AttentionBackend:
    """The interface a model layer calls: write this step's K/V, attend, return [T, H, D]."""

    # Batch-invariant inference (tidal.model.batch_invariant): every query row, a decode's
    # too, through the prefill kernel, whose row attends over its own context in the same
    # steps whatever else the call holds (TorchAttention; set by the worker).
    batch_invariant = False

    def decode_bias(self, context_lens: list[int], width: int, device: str,
                    tree: list[tuple[int, int]] | None = None) -> torch.Tensor | None:
        """Whatever mask the decode path needs, built once a step by the runner (`tree`:
        the rows' (start, bits), as `AttentionMetadata.decode_tree`)."""
        return None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata, window: int = 0, written: bool = False) -> torch.Tensor:
        """`window` > 0: a token attends only to the last `window` positions, itself
        included (HF's sliding window: kv > q - window). `written`: k and v are in the
        cache already (a fused RoPE + cache-write kernel put them there)."""
        raise NotImplementedError


class TorchAttention(AttentionBackend):
    """Prefill: one causal SDPA per sequence (over cache + new tokens when a prefix is
    cached), or, in a step where some prefill reads a cached prefix, every prefill of the
    step in one call of a paged prefill kernel reading the cache in place (Triton on CUDA,
    tidal's C++ on CPU). Decode on CPU with tidal's C++ kernel: it reads each sequence's
    blocks in place.
    Otherwise a single sequence takes SDPA over its exact context; a batch takes one
    bmm of each sequence's query heads against all its gathered K rows (every KV head), with
    a bias that masks the padding and the KV heads a query head does not use. That computes
    Hkv times the scores it keeps, but as B matrices instead of B * Hkv tiny ones, whose
    per-matrix overhead dominates on CPU (5-10x faster at Hkv = 3 and contexts up to ~200).
    A sliding window masks what lies before it on every path (the C++ kernel starts there).
    Soft-capped scores (Gemma 2: cap * tanh(scores / cap)) take eager attention where SDPA
    would run, the bmm for batched decodes, and never the C++ kernel."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int,
                 paged_kernel=None, scale: float = 0.0, softcap: float = 0.0,
                 prefill_kernel=None, kv: KVFormat = AUTO) -> None:
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.kv = kv  # the cache's element format: rows are decoded as they are read
        self.scale = scale or head_dim ** -0.5
        self.softcap = softcap
        self.groups = num_heads // num_kv_heads
        # `paged_decode_attention(q, k_cache, v_cache, tables, lens, scale, window, tree)` for
        # decodes: the C++ kernel on CPU (tidal.model.cpu_decode), Triton's on CUDA
        # (tidal.model.kernels); None: SDPA or gather + bmm.
        self.paged_kernel = None if softcap else paged_kernel
        # `paged_prefill_attention(q, k_cache, v_cache, tables, starts, lens, scale,
        # max_query_len, window)` (Triton on CUDA, C++ on CPU): every prefill of a step in
        # one call.
        self.prefill_kernel = None if softcap else prefill_kernel
        # A step whose prefills all start fresh (no cached prefix) runs SDPA instead, unless
        # one of its runs takes at least this many scores (its tokens squared): SDPA's flash
        # attention beat the Triton kernel 1.25x on an H100 (docs/performance.md); on CPU the
        # C++ kernel's bf16 products over bf16 rows beat SDPA 2-2.8x, from the size at which
        # PyTorch's path attends in bf16 too (BF16_ATTENTION_SCORES). None: always SDPA;
        # 0: always the kernel (benchmarks compare the two).
        self.fresh_kernel_scores: int | None = None

    @classmethod
    def for_arch(cls, arch, paged_kernel=None, prefill_kernel=None,
                 kv: KVFormat = AUTO) -> "TorchAttention":
        """The backend of a `ModelArch`: its heads, query scale and soft-cap."""
        return cls(arch.num_heads, arch.num_kv_heads, arch.head_dim, paged_kernel,
                   arch.attn_scale, arch.attn_softcap, prefill_kernel, kv)

    def _attend(self, q, ks, vs, mask=None, causal=False) -> torch.Tensor:
        """[Lq, H, D] queries over [Lk, Hkv, D] keys/values: SDPA, or eager attention with
        soft-capped scores. `mask`: bool [Lq, Lk], True where a query may look."""
        q, ks, vs = (t.transpose(0, 1) for t in (q, ks, vs))  # heads first
        if not self.softcap:
            o = F.scaled_dot_product_attention(q.unsqueeze(0), ks.unsqueeze(0), vs.unsqueeze(0),
                                               attn_mask=mask, is_causal=causal,
                                               scale=self.scale, enable_gqa=True)
            return o.squeeze(0).transpose(0, 1)
        ks, vs = (t.repeat_interleave(self.groups, dim=0) for t in (ks, vs))
        scores = torch.matmul(q, ks.transpose(1, 2)).float() * self.scale
        scores = torch.tanh(scores / self.softcap) * self.softcap
        if causal:
            mask = torch.ones(q.shape[1], ks.shape[1], dtype=torch.bool,
                              device=q.device).tril_(ks.shape[1] - q.shape[1])
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        o = torch.matmul(torch.softmax(scores, dim=-1).to(q.dtype), vs)
        return o.transpose(0, 1)

    def decode_bias(self, context_lens, width, device, tree=None):
        if len(context_lens) == 1 or self.paged_kernel is not None:  # the kernel masks itself
            return None
        cols = torch.arange(width, device=device)[None, :]
        pad = cols >= torch.tensor(context_lens, device=device)[:, None]  # [B, L]
        if tree is not None:  # a tree row hides the other branches' positions too
            start, bits = torch.tensor(tree, dtype=torch.long, device=device).unbind(1)
            rel = cols - start[:, None]
            seen = (bits[:, None] >> rel.clamp(0, 63)) & 1 == 1
            pad |= (rel >= 0) & ((rel > 63) | ~seen)
        kv_head = torch.arange(self.num_kv_heads, device=device)
        own = (torch.arange(self.num_heads, device=device)[:, None] // self.groups
               == kv_head[None, :])  # [H, Hkv]: query head h reads KV head h // groups
        keep = ~pad[:, None, :, None] & own[None, :, None, :]  # [B, H, L, Hkv]
        bias = torch.zeros(keep.shape, device=device).masked_fill_(~keep, float("-inf"))
        return bias.view(len(context_lens), self.num_heads, -1)

    def forward(self, q, k, v, k_cache, v_cache, meta, window=0, written=False):
        # q: [T, H, D]; k, v: [T, Hkv, D]; caches: [num_blocks, block_size, Hkv, D]
        if not written:
            self.kv.write(k_cache, meta.slot_mapping, k)
            self.kv.write(v_cache, meta.slot_mapping, v)
        if not meta.prefills:  # a decode-only step: no runs to stitch together
            return self._decode(q, k_cache, v_cache, meta, window)
        out, p = torch.empty_like(q), meta.num_prefill_tokens
        paged = None
        if meta.prefill_tables is not None and self.prefill_kernel is not None:
            paged = self._kernel("prefill_kernel", q[:p], k_cache, v_cache, meta.prefill_tables,
                                 meta.query_starts, meta.prefill_lens, self.scale,
                                 meta.max_query_len, window)
        if paged is None:
            self._prefill_each(q, k, v, k_cache, v_cache, meta, window, out)
        else:
            out[:p] = paged
        if meta.decode_block_tables is not None:
            out[meta.num_prefill_tokens:] = self._decode(q[meta.num_prefill_tokens:],
                                                         k_cache, v_cache, meta, window)
        return out

    def _kernel(self, name: str, q: torch.Tensor, *args) -> torch.Tensor | None:
        """self.<name>(q, *args); None once it fails on a GPU (a kernel that does not
        compile there): it is dropped with a warning and PyTorch ops take over for good."""
        try:
            return getattr(self, name)(q, *args)
        except Exception as exc:
            if q.device.type == "cpu":
                raise
            log.warning("%s failed (%s); running PyTorch ops instead", name, exc)
            setattr(self, name, None)
            return None

    def _prefill_each(self, q, k, v, k_cache, v_cache, meta, window, out) -> None:
        """One SDPA per prefill (over its cached prefix too, when it has one); in bf16 for
        a large run of a float32 model over a bf16 cache, or a quantized one on AMX
        (BF16_ATTENTION_SCORES)."""
        low = (q.dtype == torch.float32 and not self.softcap
               and (self.kv.name == "bfloat16" or (self.kv.quantized and BF16_OVER_CODES
                                                   and q.device.type == "cpu")))
        for i, seq in enumerate(meta.prefills):
            end = seq.start + seq.length
            scores = seq.length * (seq.cached + seq.length)
            dtype = torch.bfloat16 if low and scores >= BF16_ATTENTION_SCORES else q.dtype
            mask, causal = seq.mask, seq.cached == 0
            if seq.cached == 0:
                ks, vs = k[seq.start:end].to(dtype), v[seq.start:end].to(dtype)
            else:  # tables and masks are built here only when a kernel was to run
                table = seq.table if seq.table is not None else meta.prefill_tables[i]
                ks = self._gather(k_cache, table, dtype)[:seq.cached + seq.length]
                vs = self._gather(v_cache, table, dtype)[:seq.cached + seq.length]
                if mask is None:
                    mask = prefix_causal_mask(seq.cached, seq.length, q.device)
            if window and seq.cached + seq.length > window:  # some keys fall out of the window
                mask, causal = self._window_mask(seq, window, meta), False
            out[seq.start:end] = self._attend(q[seq.start:end].to(dtype), ks, vs, mask, causal)

    @staticmethod
    def _window_mask(seq: PrefillSeq, window: int, meta: AttentionMetadata) -> torch.Tensor:
        """[len, cached + len]: query at position p reads keys p - window < j <= p."""
        key = ("prefill", seq.start, window)
        if key not in meta.window_masks:
            dev = meta.slot_mapping.device
            rows = torch.arange(seq.cached, seq.cached + seq.length, device=dev)[:, None]
            cols = torch.arange(seq.cached + seq.length, device=dev)[None, :]
            meta.window_masks[key] = (cols <= rows) & (cols > rows - window)
        return meta.window_masks[key]

    def _decode_window_bias(self, meta: AttentionMetadata, window: int) -> torch.Tensor:
        """decode_bias with the positions before each sequence's window masked too."""
        key = ("decode", window)
        if key not in meta.window_masks:
            b, cache_len = len(meta.decode_lens), meta.decode_bias.shape[-1] // self.num_kv_heads
            dev = meta.decode_bias.device
            old = (torch.arange(cache_len, device=dev)[None, :]
                   < (meta.decode_lens - window)[:, None])  # [B, L]
            old = old[:, None, :, None].expand(b, 1, cache_len, self.num_kv_heads)
            meta.window_masks[key] = meta.decode_bias.masked_fill(
                old.reshape(b, 1, -1), float("-inf"))
        return meta.window_masks[key]

    def _gather(self, cache: torch.Tensor, table: torch.Tensor,
                dtype: torch.dtype) -> torch.Tensor:
        """[len(table) * block_size, Hkv, D]: one sequence's context in order."""
        return self.kv.decode(cache.index_select(0, table).flatten(0, 1), dtype)

    def _decode(self, q, k_cache, v_cache, meta, window=0) -> torch.Tensor:
        tables = meta.decode_block_tables
        if self.batch_invariant:  # each decode row a one-token run of the prefill kernel
            if meta.decode_tree is not None:
                raise ValueError("batch-invariant attention verifies paths, not trees")
            if meta.decode_starts is None:  # the step's layers share them
                meta.decode_starts = torch.arange(tables.shape[0] + 1, device=q.device)
            return self.prefill_kernel(q, k_cache, v_cache, tables, meta.decode_starts,
                                       meta.decode_lens, self.scale, 1, window)
        if self.paged_kernel is not None:
            o = self._kernel("paged_kernel", q, k_cache, v_cache, tables, meta.decode_lens,
                             self.scale, window, meta.decode_tree)
            if o is not None:
                return o
            if tables.shape[0] > 1:  # the step was prepared for the kernel: no bias yet
                tree = meta.decode_tree
                meta.decode_bias = self.decode_bias(meta.decode_lens.tolist(),
                                                    tables.shape[1] * k_cache.shape[1],
                                                    q.device,
                                                    None if tree is None else tree.tolist())
        if tables.shape[0] == 1:  # no padding to mask: attend over the exact context
            n = meta.decode_max_len
            first = max(0, n - window) if window else 0
            ks = self._gather(k_cache, tables[0], q.dtype)[first:n]
            vs = self._gather(v_cache, tables[0], q.dtype)[first:n]
            return self._attend(q, ks, vs)  # q [1, H, D]: the one decode token
        b, flat = tables.shape[0], tables.view(-1)
        ks = self.kv.decode(k_cache.index_select(0, flat), q.dtype).view(b, -1, self.head_dim)
        vs = self.kv.decode(v_cache.index_select(0, flat), q.dtype).view(b, -1, self.head_dim)
        bias = self._decode_window_bias(meta, window) if window else meta.decode_bias
        scores = torch.bmm(q, ks.transpose(1, 2)).float() * self.scale
        if self.softcap:
            scores = torch.tanh(scores / self.softcap) * self.softcap
        scores = scores + bias
        return torch.bmm(torch.softmax(scores, dim=-1).to(q.dtype), vs)  # [B, H, D]
