"""tidal's Triton paged prefill attention (tidal/model/kernels/prefill_attention.py) against a
PyTorch reference over each sequence's gathered context. Without CUDA it runs under Triton's
interpreter (TRITON_INTERPRET=1) on CPU tensors; skipped where triton is not installed."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from triton_setup import DEVICE, random_cache  # first: sets Triton's interpreter up without CUDA

from paged_reference import (check_chunks_equal_a_whole_prefill,
                             check_reads_nothing_past_the_context, gathered_prefill)

from tidal.model.kernels.prefill_attention import paged_prefill_attention
from tidal.model.kv_quant import KVFormat


def run_kernel(q, k_cache, v_cache, tables, new, lens, scale, window=0):
    """The kernel on DEVICE, from per-sequence new-token counts; the result on the CPU."""
    starts = torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()], dtype=torch.int32)
    lens_t = torch.tensor(lens, dtype=torch.int32)
    got = paged_prefill_attention(*(x.to(DEVICE) for x in (q, k_cache, v_cache, tables,
                                                           starts, lens_t)),
                                  scale, max(new), window)
    return got.cpu(), starts, lens_t


@settings(max_examples=20, deadline=None)
@given(data=st.data(), batch=st.integers(1, 4),
       heads=st.sampled_from([(2, 2), (6, 2), (8, 2), (16, 2)]),  # GQA 1, 3, 4, 8
       head_dim=st.sampled_from([64, 128]), block_size=st.sampled_from([16, 32]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       long=st.sampled_from([False, False, True]), window=st.sampled_from([0, 0, 7, 100]),
       kv=st.sampled_from(["auto", "auto", "int8", "fp8_e4m3"]))
def test_paged_prefill_attention_equals_the_gathered_context(data, batch, heads, head_dim,
                                                             block_size, dtype, long, window,
                                                             kv):
    """Ragged cached prefixes (sometimes long: many key tiles) and new-token runs (several
    query tiles), shuffled block tables sharing blocks across sequences, GQA, windows; the
    interpreter takes seconds for the longest, hence the rarer `long`."""
    h, hkv = heads
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    top = 1500 if long else 300
    prefix = [data.draw(st.integers(0, top)) for _ in range(batch)]
    new = [data.draw(st.integers(1, 100)) for _ in range(batch)]
    lens = [p + n for p, n in zip(prefix, new)]
    k_cache, v_cache, tables = random_cache(gen, lens, block_size, hkv, head_dim, dtype, kv)
    q = torch.randn(sum(new), h, head_dim, generator=gen).to(dtype)
    scale = head_dim ** -0.5
    got, starts, lens_t = run_kernel(q, k_cache, v_cache, tables, new, lens, scale, window)
    fmt = KVFormat(kv)
    want = gathered_prefill(q, fmt.decode(k_cache, torch.float32),
                            fmt.decode(v_cache, torch.float32), tables, starts, lens_t, scale,
                            window)
    assert got.dtype == dtype and got.shape == q.shape
    tol = 2e-5 if dtype == torch.float32 else 1.6e-2
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("window", [0, 7])
def test_chunks_in_the_middle_equal_the_rows_of_a_whole_prefill(window):
    """A prefix, a chunk in the middle and the tail."""
    check_chunks_equal_a_whole_prefill(run_kernel, window, (37, 40, 13))


def test_reads_nothing_past_the_context():
    check_reads_nothing_past_the_context(run_kernel)


def test_refuses_heads_that_do_not_share_kv_heads():
    cache = torch.zeros(2, 16, 3, 64)
    with pytest.raises(ValueError, match="multiple of the cache's 3 KV heads"):
        paged_prefill_attention(torch.zeros(1, 4, 64), cache, cache,
                                torch.zeros(1, 1, dtype=torch.int32),
                                torch.tensor([0, 1], dtype=torch.int32),
                                torch.ones(1, dtype=torch.int32), 1.0, 1)
