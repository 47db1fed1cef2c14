"""tidal's Triton kernels (tidal/model/kernels) against PyTorch references. Without CUDA they
run under Triton's interpreter (TRITON_INTERPRET=1) on CPU tensors, so CI checks the very
kernel code a GPU compiles; skipped where triton is not installed (the `gpu` extra)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from triton_setup import DEVICE, random_cache  # first: sets Triton's interpreter up without CUDA

from test_cpu_decode import gathered_attention
from test_spec_trees import random_tree_rows, tree_attention
from tidal.model.kernels.paged_attention import (MIN_SPLIT_TOKENS, num_splits,
                                                 paged_decode_attention)
from tidal.model.kv_quant import KVFormat


@settings(max_examples=25, deadline=None)
@given(data=st.data(), batch=st.integers(1, 4),
       heads=st.sampled_from([(2, 2), (6, 2), (8, 2), (16, 2)]),  # GQA 1, 3, 4, 8
       head_dim=st.sampled_from([64, 128]), block_size=st.sampled_from([16, 32]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       long=st.booleans(), window=st.sampled_from([0, 0, 0, 7, 100]),
       kv=st.sampled_from(["auto", "auto", "int8", "fp8_e4m3"]))
def test_paged_decode_attention_equals_the_gathered_context(data, batch, heads, head_dim,
                                                            block_size, dtype, long, window,
                                                            kv):
    """Ragged lengths (1 to a few thousand: several splits), shuffled block tables sharing
    blocks, GQA, windows, quantized rows."""
    h, hkv = heads
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    top = 3000 if long else 80
    lens = [data.draw(st.integers(1, top)) for _ in range(batch)]
    k_cache, v_cache, tables = random_cache(gen, lens, block_size, hkv, head_dim, dtype, kv)
    q = torch.randn(batch, h, head_dim, generator=gen).to(dtype)
    lens_t = torch.tensor(lens, dtype=torch.int32)
    scale = head_dim ** -0.5
    fmt = KVFormat(kv)
    want = gathered_attention(q, fmt.decode(k_cache, torch.float32),
                              fmt.decode(v_cache, torch.float32), tables.long(), lens_t, scale,
                              window)
    got = paged_decode_attention(*(x.to(DEVICE) for x in (q, k_cache, v_cache, tables,
                                                           lens_t)), scale, window)
    assert got.dtype == dtype and got.shape == q.shape
    tol = 2e-5 if dtype == torch.float32 else 1.6e-2
    torch.testing.assert_close(got.float().cpu(), want, atol=tol, rtol=tol)


def test_splits_cover_the_context_in_whole_blocks():
    """Short splits while few sequences run, longer ones as the batch fills the GPU; the
    length never depends on the context, only on (sequences x KV heads)."""
    for max_len, block, programs in ((1, 16, 1), (512, 16, 8), (513, 16, 2), (3000, 32, 64),
                                     (100_000, 16, 8), (8192, 16, 512), (8192, 128, 4096)):
        splits, per = num_splits(max_len, block, programs)
        assert per % block == 0 and per >= MIN_SPLIT_TOKENS
        assert splits * per >= max_len > (splits - 1) * per
        assert per == num_splits(max_len * 7 + 3, block, programs)[1]
    assert num_splits(1024, 16, 8) == (1024 // MIN_SPLIT_TOKENS, MIN_SPLIT_TOKENS)
    assert num_splits(1024, 16, 512)[0] == 1  # 64 sequences of 8 KV heads: no split


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_wider_table_gives_the_same_bits(dtype):
    """A CUDA graph's tables are as wide as the longest context the engine allows: the
    result equals an eager step's bit for bit, so graph and eager decode agree."""
    gen = torch.Generator().manual_seed(5)
    lens = [1, 70, 300, 129]
    k_cache, v_cache, tables = random_cache(gen, lens, 16, 2, 64, dtype)
    q = torch.randn(len(lens), 4, 64, generator=gen).to(dtype)
    wide = torch.cat([tables, torch.zeros(len(lens), 100, dtype=torch.int32)], dim=1)
    lens_t = torch.tensor(lens, dtype=torch.int32)
    narrow_out, wide_out = (paged_decode_attention(*(x.to(DEVICE) for x in (
        q, k_cache, v_cache, t, lens_t)), 0.125) for t in (tables, wide))
    assert num_splits(wide.shape[1] * 16, 16, 8)[0] > num_splits(tables.shape[1] * 16, 16, 8)[0] > 1
    assert torch.equal(narrow_out, wide_out)


def test_refuses_heads_that_do_not_share_kv_heads():
    cache = torch.zeros(2, 16, 3, 64)
    with pytest.raises(ValueError, match="multiple of the cache's 3 KV heads"):
        paged_decode_attention(torch.zeros(1, 4, 64), cache, cache,
                               torch.zeros(1, 1, dtype=torch.int32),
                               torch.ones(1, dtype=torch.int32), 1.0)


@pytest.mark.skipif(DEVICE == "cuda", reason="the interpreter's stand-in for the GPU path: "
                    "test_gpu.py runs the real one")
@pytest.mark.parametrize("kv", ["auto", "int8", "fp8_e4m3"])
def test_a_model_decodes_the_same_through_the_kernel(tmp_path, kv):
    """A tiny Llama's greedy tokens with the Triton kernel under its decodes equal the
    PyTorch path's (the runner uses it on CUDA), over caches of float32 or quantized rows."""
    from model_fixtures import PROMPTS, tiny_folder
    from tidal import LLM, SamplingParams

    folder = tiny_folder(tmp_path, "llama")
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)

    def tokens(kernel) -> list[list[int]]:
        llm = LLM(str(folder), dtype="float32", num_kv_blocks=64, block_size=16,
                  kv_cache_dtype=kv)
        llm.engine.runner.decoder = None  # every decode through the attention backend
        llm.engine.runner.model.backend.paged_kernel = kernel
        prompts = [{"prompt_token_ids": llm.engine.tokenize(p)} for p in PROMPTS[:3]]
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

    calls = []

    def counted(*args):
        calls.append(args[0].shape[0])
        return paged_decode_attention(*args)

    assert tokens(counted) == tokens(None)
    assert len(calls) >= 11 * 2 and max(calls) == 3  # every decode step, every layer


@pytest.mark.skipif(DEVICE == "cuda", reason="the interpreter's stand-in for the GPU path: "
                    "test_gpu.py runs the real one")
def test_the_whole_gpu_path_gives_the_pytorch_paths_tokens(tmp_path):
    """What the runner runs on CUDA, on CPU: decode steps replayed through graph buckets
    (EagerReplay: same static inputs, padding and null block), the paged decode and prefill
    kernels, the fused norm and RoPE kernels, chunked prefill and a prefix-cache hit. The
    tokens equal the PyTorch path's, call for call."""
    from model_fixtures import prefix_hit_tokens, tiny_folder
    from tidal import LLM, SamplingParams
    from tidal.engine.decode_graphs import EagerReplay
    from tidal.model.kernels import FusedKernels, fused_kernels
    from tidal.model.kernels.prefill_attention import paged_prefill_attention

    folder = tiny_folder(tmp_path, "llama")
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)

    def runs(gpu_path: bool) -> list[list[list[int]]]:
        llm = LLM(str(folder), dtype="float32", num_kv_blocks=64, block_size=4,
                  chunked_prefill_size=8, max_num_seqs=4)
        runner = llm.engine.runner
        runner.decoder = None
        if gpu_path:
            runner.model.backend.paged_kernel = paged_decode_attention
            runner.model.backend.prefill_kernel = \
                lambda *a: prefill_calls.append(1) or paged_prefill_attention(*a)
            k = fused_kernels()
            runner.model.kernels = FusedKernels(
                k.rms_norm, k.add_rms_norm, lambda *a: rope_calls.append(1) or k.rope_and_cache(*a))
            runner.use_decode_graphs(EagerReplay(), max_num_seqs=4, max_model_len=128)
        out = prefix_hit_tokens(llm, params)
        if gpu_path:
            assert runner.graphs.replays >= 2 * 9
        return out

    rope_calls, prefill_calls = [], []
    assert runs(True) == runs(False)
    # every step (prefill too) in every layer; chunks of 8 tokens: several prefill steps
    assert len(rope_calls) > len(prefill_calls) >= 2 * 4


@settings(max_examples=10, deadline=None)
@given(data=st.data(), batch=st.integers(1, 3), dtype=st.sampled_from([torch.float32,
                                                                       torch.bfloat16]))
def test_tree_rows_see_only_their_own_branch(data, batch, dtype):
    """A speculation tree's rows (`tree`: each row's start and bits) against attention over
    the positions each one sees."""
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    k_cache, v_cache, tables, lens, tree = random_tree_rows(data, batch, 16, 2, 64, dtype, gen)
    q = torch.randn(batch, 4, 64, generator=gen).to(dtype)
    want = tree_attention(q, k_cache, v_cache, tables, lens, tree, 0.125)
    got = paged_decode_attention(*(x.to(DEVICE) for x in (q, k_cache, v_cache, tables, lens)),
                                 0.125, tree=tree.to(DEVICE))
    tol = 2e-5 if dtype == torch.float32 else 1.6e-2
    torch.testing.assert_close(got.float().cpu(), want, atol=tol, rtol=tol)
