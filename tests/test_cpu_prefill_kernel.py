"""tidal's C++ paged prefill attention (csrc/prefill_attention.cpp) against attention over
each sequence's gathered context, and the CPU runner's steps through it against the PyTorch
path's."""

from __future__ import annotations

import shutil

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from paged_reference import (check_chunks_equal_a_whole_prefill,
                             check_reads_nothing_past_the_context, gathered_prefill,
                             random_cache)
from tidal.model import cpu_decode
from tidal.model.kv_quant import KVFormat

ext = cpu_decode.extension()
pytestmark = pytest.mark.skipif(ext is None and shutil.which("c++") is None,
                                reason="no C++ compiler here")


def run_kernel(q, k_cache, v_cache, tables, new, lens, scale, window=0):
    """The kernel from per-sequence new-token counts; also the starts and lengths it took."""
    starts = torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()], dtype=torch.int32)
    lens_t = torch.tensor(lens, dtype=torch.int32)
    got = ext.paged_prefill_attention(q, k_cache, v_cache, tables, starts, lens_t, scale,
                                      max(new), window)
    return got, starts, lens_t


@settings(max_examples=40, deadline=None)
@given(data=st.data(), batch=st.integers(1, 4),
       heads=st.sampled_from([(2, 2), (6, 2), (9, 3), (10, 2), (16, 2)]),  # GQA 1, 3, 5, 8
       head_dim=st.sampled_from([64, 128, 80, 12]), block_size=st.sampled_from([16, 12]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       window=st.sampled_from([0, 0, 7, 100]),
       kv=st.sampled_from(["auto", "auto", "bfloat16", "int8", "fp8_e4m3"]))
def test_paged_prefill_attention_equals_the_gathered_context(data, batch, heads, head_dim,
                                                             block_size, dtype, window, kv):
    """Ragged cached prefixes and new-token runs (up to 300: a KV head's rows in several
    panels, a panel ending inside a token's heads where the group is odd), shuffled block
    tables sharing blocks, GQA, head dims off the vector width (float32 products there),
    windows, every cache format (bf16 rows under a float32 model too)."""
    h, hkv = heads
    if kv == "bfloat16" and dtype == torch.bfloat16:
        kv = "auto"
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    prefix = [data.draw(st.integers(0, data.draw(st.sampled_from([40, 700]))))
              for _ in range(batch)]
    new = [data.draw(st.integers(1, 300)) for _ in range(batch)]
    lens = [p + n for p, n in zip(prefix, new)]
    fmt = KVFormat(kv)
    k_cache, v_cache, tables = random_cache(gen, lens, block_size, hkv, head_dim, dtype,
                                            "auto" if kv == "bfloat16" else kv)
    if kv == "bfloat16":
        k_cache, v_cache = k_cache.bfloat16(), v_cache.bfloat16()
    q = torch.randn(sum(new), h, head_dim, generator=gen).to(dtype)
    scale = head_dim ** -0.5
    got, starts, lens_t = run_kernel(q, k_cache, v_cache, tables, new, lens, scale, window)
    want = gathered_prefill(q, fmt.decode(k_cache, torch.float32),
                            fmt.decode(v_cache, torch.float32), tables, starts, lens_t, scale,
                            window)
    assert got.dtype == dtype and got.shape == q.shape
    # bf16 products (AVX512-BF16) over bf16 and quantized rows round q, k, v and the weights
    bf16 = dtype == torch.bfloat16 or (kv != "auto" and ext.prefill_bf16_dots)
    tol = 1.6e-2 if bf16 else 2e-5
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("window", [0, 7])
def test_chunks_equal_the_rows_of_a_whole_prefill(window):
    """A prefix, a chunk in the middle and the tail (140 rows of 8 heads: several panels)."""
    check_chunks_equal_a_whole_prefill(run_kernel, window, (37, 140, 13))


def test_reads_nothing_past_the_context():
    check_reads_nothing_past_the_context(run_kernel)


def test_refuses_what_would_read_outside_the_cache():
    cache = torch.zeros(2, 16, 3, 64)
    table = torch.zeros(1, 1, dtype=torch.int32)
    starts = torch.tensor([0, 1], dtype=torch.int32)
    with pytest.raises(ValueError, match="multiple of the cache's 3 KV heads"):
        ext.paged_prefill_attention(torch.zeros(1, 4, 64), cache, cache, table, starts,
                                    torch.ones(1, dtype=torch.int32), 1.0, 1)
    with pytest.raises(RuntimeError, match="does not fit its block table"):
        ext.paged_prefill_attention(torch.zeros(1, 3, 64), cache, cache, table, starts,
                                    torch.tensor([17], dtype=torch.int32), 1.0, 1)
    with pytest.raises(RuntimeError, match="not in the cache"):
        ext.paged_prefill_attention(torch.zeros(1, 3, 64), cache, cache, table + 2, starts,
                                    torch.ones(1, dtype=torch.int32), 1.0, 1)
    with pytest.raises(RuntimeError, match="at most its context"):
        ext.paged_prefill_attention(torch.zeros(3, 3, 64), cache, cache, table,
                                    torch.tensor([0, 3], dtype=torch.int32),
                                    torch.tensor([2], dtype=torch.int32), 1.0, 3)


@pytest.mark.parametrize("kv", ["auto", "bfloat16", "int8"])
def test_the_runner_computes_chunks_after_a_prefix_through_it(tmp_path, kv):
    """Chunked prompts and a prefix-cache hit on the CPU runner: every layer of every step
    with a chunk after cached tokens calls the kernel, and the greedy tokens equal those of
    the PyTorch path (gathered context, SDPA)."""
    from model_fixtures import prefix_hit_tokens, tiny_folder
    from tidal import LLM, SamplingParams

    folder = tiny_folder(tmp_path, "llama")
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    calls: list[int] = []

    def runs(kernel: bool) -> list[list[list[int]]]:
        llm = LLM(str(folder), dtype="float32", num_kv_blocks=64, block_size=4,
                  chunked_prefill_size=8, max_num_seqs=4, kv_cache_dtype=kv)
        backend = llm.engine.runner.model.backend
        if kernel:
            backend.prefill_kernel = \
                lambda *a: calls.append(a[0].shape[0]) or ext.paged_prefill_attention(*a)
        else:
            backend.prefill_kernel = None
        out = prefix_hit_tokens(llm, params)
        llm.close()
        return out

    assert runs(True) == runs(False)
    layers = 2  # tiny_folder's
    assert len(calls) >= layers * 4  # every layer of several steps


def test_it_runs_where_it_beats_the_pytorch_path(tmp_path):
    """Over quantized rows always, over bf16 rows with bf16 products; fresh prompts where the
    products are bf16 (from 256 x 256 scores; over bf16 rows a bf16 model's always); over
    float32 rows never (it ties SDPA there); on AMX CPUs never (their bf16 SDPA)."""
    from model_fixtures import tiny_folder
    from tidal import LLM
    from tidal.model.attention import BF16_ATTENTION_SCORES, BF16_OVER_CODES

    folder = tiny_folder(tmp_path, "llama")
    for kv, runs in (("auto", False), ("bfloat16", ext.prefill_bf16_dots), ("int8", True),
                     ("fp8_e4m3", True)):
        llm = LLM(str(folder), dtype="float32", num_kv_blocks=16, kv_cache_dtype=kv)
        backend = llm.engine.runner.model.backend
        llm.close()
        assert (backend.prefill_kernel is not None) == (runs and not BF16_OVER_CODES), kv
        assert backend.fresh_kernel_scores == (
            BF16_ATTENTION_SCORES if backend.prefill_kernel is not None and (
                kv != "auto" and ext.prefill_bf16_dots) else None), kv
    if ext.prefill_bf16_dots and not BF16_OVER_CODES:  # a bf16 model: fresh prompts at any size
        llm = LLM(str(folder), dtype="bfloat16", num_kv_blocks=16)
        assert llm.engine.runner.model.backend.fresh_kernel_scores == 0
        llm.close()


@pytest.mark.skipif(ext is None or not ext.prefill_bf16_dots, reason="no bf16 products here")
@pytest.mark.parametrize("kv", ["bfloat16", "int8"])
def test_fresh_prompts_take_it_from_256_by_256_scores(tmp_path, kv):
    """A fresh 300-token prompt attends through the kernel; a fresh 100-token one through
    SDPA over its own float32 k and v (a README-sized first answer keeps its logprobs)."""
    from model_fixtures import tiny_folder
    from tidal import LLM, SamplingParams
    from tidal.model.attention import BF16_OVER_CODES

    if BF16_OVER_CODES:
        pytest.skip("AMX CPUs keep PyTorch's path")
    llm = LLM(str(tiny_folder(tmp_path, "llama")), dtype="float32", num_kv_blocks=64,
              kv_cache_dtype=kv)
    backend, calls = llm.engine.runner.model.backend, []
    kernel = backend.prefill_kernel
    backend.prefill_kernel = lambda *a: calls.append(a[0].shape[0]) or kernel(*a)
    one = SamplingParams(max_tokens=1, ignore_eos=True)
    for first, n in ((5, 100), (1000, 300)):  # no shared prefix
        llm.generate([{"prompt_token_ids": list(range(first, first + n))}], one,
                     use_tqdm=False)
    llm.close()
    assert calls and set(calls) == {300}  # every layer of the 300-token step, none of the 100
