"""tidal's fused Triton kernels (residual add + RMSNorm; RoPE + KV cache write) against the
PyTorch code they stand in for (tidal.model.llama's RMSNorm and apply_rope, the backend's
index_copy_ into the cache). Without CUDA they run under Triton's interpreter
(TRITON_INTERPRET=1) on CPU tensors; skipped where triton is not installed (the `gpu`
extra)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from triton_setup import DEVICE  # first: sets Triton's interpreter up without CUDA

from tidal.model.kernels.norm import fused_add_rms_norm, rms_norm
from tidal.model.kernels.rope_cache import rope_and_cache
from tidal.model.llama import RMSNorm, apply_rope
from ulps import assert_close_ulps


def reference_norm(hidden: int, eps: float, weight: torch.Tensor) -> RMSNorm:
    norm = RMSNorm(hidden, eps).to(weight.dtype)
    norm.weight.data.copy_(weight)
    return norm


@settings(max_examples=30, deadline=None)
@given(data=st.data(), tokens=st.integers(1, 40), hidden=st.sampled_from([64, 96, 576]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       eps=st.sampled_from([1e-5, 1e-6]), residual=st.booleans())
def test_rms_norm_equals_llamas(data, tokens, hidden, dtype, eps, residual):
    """With and without the residual add, widths that are and are not powers of two."""
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    scale = data.draw(st.sampled_from([0.01, 1.0, 30.0]))  # the norm's input's magnitude
    x = (torch.randn(tokens, hidden, generator=gen) * scale).to(dtype)
    res = (torch.randn(tokens, hidden, generator=gen) * scale).to(dtype)
    weight = (1 + 0.3 * torch.randn(hidden, generator=gen)).to(dtype)
    norm = reference_norm(hidden, eps, weight)
    with torch.no_grad():
        if residual:
            want_res = x + res
            want = norm(want_res)
            got, got_res = fused_add_rms_norm(x.to(DEVICE), res.to(DEVICE),
                                              weight.to(DEVICE), eps)
            assert torch.equal(got_res.cpu(), want_res)  # one rounding of the sum, as h + a
        else:
            want = norm(x)
            got = rms_norm(x.to(DEVICE), weight.to(DEVICE), eps)
    assert_close_ulps(got, want, tol=1e-5)


def test_rms_norm_takes_leading_dims_and_strided_rows():
    """[T, heads, D] (qk_norm's shape), rows of a wider tensor, a 4096 wide row, a float32
    weight on bf16 rows (which PyTorch promotes), and no rows at all."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 3, 64, generator=gen).to(torch.bfloat16)
    weight = (1 + 0.3 * torch.randn(64, generator=gen)).to(torch.bfloat16)
    with torch.no_grad():
        assert_close_ulps(rms_norm(x.to(DEVICE), weight.to(DEVICE), 1e-6),
                          reference_norm(64, 1e-6, weight)(x))
        wide = torch.randn(7, 200, generator=gen)
        res = torch.randn(7, 96, generator=gen)
        w32 = torch.randn(96, generator=gen)
        got, got_res = fused_add_rms_norm(wide[:, 100:196].to(DEVICE), res.to(DEVICE),
                                          w32.to(DEVICE), 1e-5)
        assert torch.equal(got_res.cpu(), wide[:, 100:196] + res)
        assert_close_ulps(got, reference_norm(96, 1e-5, w32)(wide[:, 100:196] + res),
                          tol=1e-5)
        big = torch.randn(2, 2, 4096, generator=gen).to(torch.bfloat16)  # Llama 8B's width
        w_big = (1 + 0.3 * torch.randn(4096, generator=gen)).to(torch.bfloat16)
        got, got_res = fused_add_rms_norm(big[0].to(DEVICE), big[1].to(DEVICE),
                                          w_big.to(DEVICE), 1e-5)
        assert torch.equal(got_res.cpu(), big[0] + big[1])
        assert_close_ulps(got, reference_norm(4096, 1e-5, w_big)(big[0] + big[1]))
        mixed = rms_norm(x.to(DEVICE), weight.float().to(DEVICE), 1e-6)
        assert mixed.dtype == torch.float32
        assert_close_ulps(mixed, reference_norm(64, 1e-6, weight.float())(x), tol=1e-5)
    assert rms_norm(torch.zeros(0, 64, device=DEVICE), torch.ones(64, device=DEVICE),
                    1e-6).shape == (0, 64)
    with pytest.raises(ValueError, match="does not match"):
        fused_add_rms_norm(x, x.float(), weight, 1e-6)


def rope_tables_for(positions: torch.Tensor, rot: int, dtype: torch.dtype
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, 1, R] cos and signed sin, laid out as tidal.model.rope's tables."""
    inv = 10000.0 ** (-torch.arange(0, rot, 2, dtype=torch.float32) / rot)
    freqs = positions.float()[:, None] * inv[None, :]
    cos = torch.cat([freqs.cos(), freqs.cos()], dim=-1)
    sin = torch.cat([-freqs.sin(), freqs.sin()], dim=-1)
    return cos.unsqueeze(1).to(dtype), sin.unsqueeze(1).to(dtype)


@settings(max_examples=20, deadline=None)
@given(data=st.data(), tokens=st.integers(1, 40),
       heads=st.sampled_from([(2, 2), (6, 2), (16, 2)]),  # GQA 1, 3, 8
       head_dim=st.sampled_from([64, 128]), partial=st.booleans(),
       block_size=st.sampled_from([16, 32]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       in_place=st.booleans(), heads_per_program=st.sampled_from([None, 1, 4]))
def test_rope_and_cache_equals_apply_rope_and_index_copy(data, tokens, heads, head_dim,
                                                         partial, block_size, dtype,
                                                         in_place, heads_per_program):
    """q and k heads sliced out of one qkv projection (as Attention.forward does), full and
    partial rotary, distinct random slots over a shuffled cache, some of them -1 (padding:
    nothing written)."""
    h, hkv = heads
    if heads_per_program == 1:  # a program a head: slow under the interpreter, few tokens
        tokens = min(tokens, 4)
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    rot = head_dim // 2 if partial else head_dim
    qkv = torch.randn(tokens, h + 2 * hkv, head_dim, generator=gen).to(dtype)
    qk, v = qkv[:, :h + hkv], qkv[:, h + hkv:]
    positions = torch.randint(0, 4096, (tokens,), generator=gen)
    cos, sin = rope_tables_for(positions, rot, dtype)
    num_blocks = -(-tokens // block_size) + 3
    k_cache = torch.randn(num_blocks, block_size, hkv, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, hkv, head_dim, generator=gen).to(dtype)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens]
    if data.draw(st.booleans()):
        slots[torch.rand(tokens, generator=gen) < 0.25] = -1
    want_qk = apply_rope(qk, (cos, sin))
    want_k_cache, want_v_cache = k_cache.clone(), v_cache.clone()
    kept = slots >= 0
    want_k_cache.view(-1, hkv, head_dim).index_copy_(0, slots[kept], want_qk[kept, h:])
    want_v_cache.view(-1, hkv, head_dim).index_copy_(0, slots[kept], v[kept])

    qkv_d = qkv.to(DEVICE)
    qk_d, v_d = qkv_d[:, :h + hkv], qkv_d[:, h + hkv:]
    k_cache_d, v_cache_d = k_cache.to(DEVICE), v_cache.to(DEVICE)
    q, k = rope_and_cache(qk_d, v_d, cos.to(DEVICE), sin.to(DEVICE), k_cache_d, v_cache_d,
                          slots.to(DEVICE), h, out=qk_d if in_place else None,
                          heads_per_program=heads_per_program)
    assert q.shape == (tokens, h, head_dim) and k.shape == (tokens, hkv, head_dim)
    assert_close_ulps(q, want_qk[:, :h])
    assert_close_ulps(k, want_qk[:, h:])
    if in_place:
        assert q.data_ptr() == qkv_d.data_ptr()
        assert_close_ulps(qkv_d[:, :h + hkv], want_qk)
    assert torch.equal(qkv_d[:, h + hkv:].cpu(), v)  # v is only read
    assert_close_ulps(k_cache_d, want_k_cache)
    assert torch.equal(v_cache_d.cpu(), want_v_cache)


def test_rope_and_cache_refuses_mismatched_shapes():
    cache = torch.zeros(2, 16, 2, 64)
    cos = torch.ones(3, 1, 64)
    with pytest.raises(ValueError, match="cache's 2 heads"):
        rope_and_cache(torch.zeros(3, 7, 64), torch.zeros(3, 2, 64), cos, cos, cache, cache,
                       torch.zeros(3, dtype=torch.long), 4)
    with pytest.raises(ValueError, match="65 rotary dims"):
        rope_and_cache(torch.zeros(3, 6, 64), torch.zeros(3, 2, 64), torch.ones(3, 1, 65),
                       torch.ones(3, 1, 65), cache, cache, torch.zeros(3, dtype=torch.long), 4)
