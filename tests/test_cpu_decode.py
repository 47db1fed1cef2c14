"""tidal's C++ CPU decode path: paged attention equals attention over the gathered context
(or its sliding window), over caches of the model's dtype or of quantized rows, and a decode
step through `Decoder` equals the PyTorch path's step (logits and KV written), sliding
windows, partial rotary and quantized KV included."""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from tidal.model import cpu_decode
from tidal.model.kv_quant import KVFormat

ext = cpu_decode.extension()
# Where a compiler exists the build must work: a broken build would only show as slowness.
pytestmark = pytest.mark.skipif(ext is None and shutil.which("c++") is None,
                                reason="no C++ compiler here")


def gathered_attention(q, k_cache, v_cache, tables, lens, scale, window=0):
    """Each sequence's context (its last `window` tokens when window > 0) copied out of its
    blocks, then plain float32 attention."""
    out = []
    for b, n in enumerate(lens.tolist()):
        first = max(0, n - window) if window else 0
        k = k_cache[tables[b]].flatten(0, 1)[first:n].float().transpose(0, 1)  # [Hkv, n, D]
        v = v_cache[tables[b]].flatten(0, 1)[first:n].float().transpose(0, 1)
        o = F.scaled_dot_product_attention(q[b].float().unsqueeze(1), k, v, scale=scale,
                                           enable_gqa=True)
        out.append(o.squeeze(1))
    return torch.stack(out)


@settings(max_examples=60)
@given(data=st.data(), batch=st.integers(1, 5), heads=st.sampled_from([(1, 1), (4, 2), (9, 3),
                                                                       (8, 1)]),
       head_dim=st.sampled_from([8, 16, 24, 64, 128]), block_size=st.sampled_from([1, 4, 16]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       window=st.sampled_from([0, 0, 1, 3, 8, 17]),
       kv=st.sampled_from(["auto", "auto", "int8", "fp8_e4m3"]))
def test_paged_attention_equals_attention_over_the_gathered_context(data, batch, heads,
                                                                    head_dim, block_size,
                                                                    dtype, window, kv):
    h, hkv = heads
    num_blocks = 24
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    fmt = KVFormat(kv)
    # scales differ from row to row: each quantized row has its own
    k, v = (torch.randn(num_blocks, block_size, hkv, head_dim, generator=gen).to(dtype)
            * torch.rand(num_blocks, block_size, hkv, 1, generator=gen).to(dtype)
            for _ in range(2))
    k_cache, v_cache = (fmt.encode(x).view(fmt.storage(dtype)) if fmt.quantized else x
                        for x in (k, v))
    lens = [data.draw(st.integers(1, 40)) for _ in range(batch)]
    width = max(-(-n // block_size) for n in lens)
    # Tables in any order, sharing blocks across sequences (prefix caching), padded with 0.
    tables = torch.tensor([data.draw(st.lists(st.integers(0, num_blocks - 1), min_size=width,
                                              max_size=width)) for _ in range(batch)])
    q = torch.randn(batch, h, head_dim, generator=gen).to(dtype)
    lens_t = torch.tensor(lens)
    scale = head_dim ** -0.5
    got = ext.paged_decode_attention(q, k_cache, v_cache, tables, lens_t, scale, window)
    want = gathered_attention(q, fmt.decode(k_cache, torch.float32),
                              fmt.decode(v_cache, torch.float32), tables, lens_t, scale, window)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)


@settings(max_examples=25, deadline=None)
@given(data=st.data(), batch=st.integers(1, 4), heads=st.sampled_from([(9, 3), (4, 2), (8, 1)]),
       head_dim=st.sampled_from([24, 64]), dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       window=st.sampled_from([0, 0, 700]), kv=st.sampled_from(["auto", "auto", "int8"]))
def test_long_contexts_attend_in_spans_whose_sums_depend_on_the_row_alone(data, batch, heads,
                                                                          head_dim, dtype,
                                                                          window, kv):
    """Contexts past a span (512 positions) run as several tasks, one a span, merged by their
    softmax maxima and sums: the result is attention over the gathered context, and each row
    gets the same bits alone as in its batch, on one thread as on two (so a token does not
    depend on its batch or the thread count)."""
    h, hkv = heads
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    fmt = KVFormat(kv)
    lens = [data.draw(st.integers(1, 1900)) for _ in range(batch)]
    width = max(-(-n // 16) for n in lens)
    blocks = batch * width
    k, v = (torch.randn(blocks, 16, hkv, head_dim, generator=gen).to(dtype) for _ in range(2))
    k_cache, v_cache = (fmt.encode(x).view(fmt.storage(dtype)) if fmt.quantized else x
                        for x in (k, v))
    tables = torch.randperm(blocks, generator=gen).view(batch, width)
    q = torch.randn(batch, h, head_dim, generator=gen).to(dtype)
    lens_t, scale = torch.tensor(lens), head_dim ** -0.5
    got = ext.paged_decode_attention(q, k_cache, v_cache, tables, lens_t, scale, window)
    want = gathered_attention(q, fmt.decode(k_cache, torch.float32),
                              fmt.decode(v_cache, torch.float32), tables, lens_t, scale, window)
    tol = 2e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        for b in range(batch):
            alone = ext.paged_decode_attention(q[b:b + 1], k_cache, v_cache, tables[b:b + 1],
                                               lens_t[b:b + 1], scale, window)
            assert torch.equal(alone[0], got[b])
    finally:
        torch.set_num_threads(threads)


def test_paged_attention_refuses_what_would_read_outside_the_cache():
    cache = torch.zeros(4, 4, 1, 8)
    q, table, one = torch.zeros(1, 2, 8), torch.zeros(1, 1, dtype=torch.long), torch.ones(1)
    with pytest.raises(RuntimeError, match="KV cache"):
        ext.paged_decode_attention(q.bfloat16(), cache, cache, table, one, 1.0)
    with pytest.raises(RuntimeError, match="does not fit its block table"):
        ext.paged_decode_attention(q, cache, cache, table, torch.tensor([5]), 1.0)
    with pytest.raises(RuntimeError, match="block id 4 is not in the cache"):
        ext.paged_decode_attention(q, cache, cache, table + 4, one, 1.0)
    with pytest.raises(RuntimeError, match="2-byte scale"):  # int8 rows without their scale
        ext.paged_decode_attention(q, cache.to(torch.int8), cache.to(torch.int8), table, one,
                                   1.0)
    with pytest.raises(RuntimeError, match="head_dim"):
        ext.paged_decode_attention(torch.zeros(1, 2, 4), cache, cache, table, one, 1.0)
    pairs = torch.zeros(4, 4, 2, 8)
    with pytest.raises(RuntimeError, match="multiple of the cache's KV heads"):
        ext.paged_decode_attention(torch.zeros(1, 3, 8), pairs, pairs, table, one, 1.0)


class _Checked:
    """Stands in for the runner's decoder: runs the PyTorch path on the same step first,
    keeps what it wrote to the KV cache and wipes it, then runs the decoder; records both."""

    def __init__(self, runner):
        self.runner, self.decoder, self.steps = runner, runner.decoder, []
        build = runner.batches.build

        def keep_meta(*args):
            batch = build(*args)
            self.meta = batch.meta
            return batch
        runner.batches.build = keep_meta

    def forward(self, ids, positions, slots, tables, lens, ks, vs, rows, scale, block_size):
        ref = self.runner.model(ids, positions, self.runner.kv_caches, self.meta, rows)
        caches = [c.view(-1, *c.shape[2:]) for kv in self.runner.kv_caches for c in kv]
        written = [c[slots].clone() for c in caches]
        for c in caches:
            c[slots] = 0
        got = self.decoder.forward(ids, positions, slots, tables, lens, ks, vs, rows, scale,
                                   block_size)
        self.steps.append((ref, got, written, [c[slots] for c in caches], len(ids)))
        return got


@pytest.mark.parametrize("family,quantization,fp32_rows,dtype,kv", [
    ("llama", "none", 0, "bfloat16", "auto"), ("llama", "int4", 0, "bfloat16", "auto"),
    ("qwen2", "none", 0, "bfloat16", "auto"), ("qwen2", "int4", 0, "bfloat16", "auto"),
    ("llama", "unpacked", 0, "bfloat16", "auto"), ("llama", "none", 2, "bfloat16", "auto"),
    ("qwen2", "int4", 2, "bfloat16", "auto"), ("llama", "none", 0, "float32", "auto"),
    ("qwen2", "none", 0, "float32", "auto"), ("mistral", "none", 0, "bfloat16", "auto"),
    ("phi3", "none", 0, "bfloat16", "auto"), ("phi3", "none", 0, "float32", "auto"),
    ("llama", "none", 0, "bfloat16", "int8"), ("mistral", "none", 0, "bfloat16", "fp8_e4m3"),
    ("qwen2", "none", 0, "float32", "int8"), ("phi3", "none", 0, "float32", "fp8_e4m3")])
def test_a_decode_step_through_the_decoder_equals_the_pytorch_path(tmp_path, monkeypatch,
                                                                   family, quantization,
                                                                   fp32_rows, dtype, kv):
    """Packed bf16 or float32, int4 and (where oneDNN is missing) plain nn.Linear projections
    with the tied embedding as head; q/k/v with a bias and an untied head (qwen2); batches
    multiplied in float32 (fp32_gemm_rows); 6-token sliding windows shorter than the contexts
    (mistral, phi3) and half-head rotary (phi3); 19 rows, which oneDNN sees padded to 20;
    caches of int8 or e4m3 rows, which the decoder writes as the PyTorch path does."""
    from model_fixtures import tiny_folder
    from tidal import LLM, SamplingParams

    if quantization == "unpacked":
        monkeypatch.setattr("tidal.engine.model_loading.can_pack", lambda *args: False)
    folder = tiny_folder(tmp_path, family)
    llm = LLM(str(folder), dtype=dtype, num_kv_blocks=256, block_size=4,
              quantization="none" if quantization == "unpacked" else quantization,
              fp32_gemm_rows=fp32_rows, kv_cache_dtype=kv)
    runner = llm.engine.runner
    assert runner.decoder is not None
    head = runner.model.lm_head
    if fp32_rows and quantization != "unpacked":
        assert getattr(head, "dense", head).weight32 is not None
    checked = runner.decoder = _Checked(runner)
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    prompts = [{"prompt_token_ids": list(range(5 + i, 12 + 3 * i))} for i in range(19)]
    llm.generate(prompts, params, use_tqdm=False)  # batched decodes (bf16 weights)
    llm.generate(prompts[:1], params, use_tqdm=False)  # one row (int4 weights when asked)
    assert {n for *_, n in checked.steps} >= {1, 19}
    # The same ops, roundings and attention kernel: in bf16 bit for bit the PyTorch path's
    # step; in float32 the RMSNorm sums' order shows in the last bits (which is also why no
    # float32 case runs int4: its int8 rounding of activations would magnify them).
    tol = dict(rtol=0, atol=0) if dtype == "bfloat16" else dict(rtol=1e-4, atol=1e-4)
    fmt = runner.kv.format
    # Quantized caches give other values, of which a few round once differently after
    # attention (queries and attention outputs equal bit for bit): a bf16 step then
    # differs in a logit's last bit.
    logits_tol = dict(rtol=0, atol=0.07) if fmt.quantized and dtype == "bfloat16" else tol
    for ref, got, written, again, _ in checked.steps:
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, ref, **logits_tol)
        for a, w in zip(again, written):
            assert w.view(torch.uint8).any()
            if fmt.quantized and dtype == "bfloat16":  # the same codes and scales
                assert torch.equal(a.view(torch.uint8), w.view(torch.uint8))
            want = fmt.decode(w, torch.float32)
            # float32 inputs differ in their last bits, so a code may differ by one step
            # (up to a fourteenth of the largest value in e4m3)
            torch.testing.assert_close(fmt.decode(a, torch.float32), want, **(
                dict(rtol=0, atol=want.abs().max().item() / 10) if fmt.quantized else tol))


def test_models_the_decoder_does_not_run_keep_the_pytorch_path(tmp_path):
    from model_fixtures import tiny_folder
    from tidal import LLM

    qwen3 = LLM(str(tiny_folder(tmp_path, "qwen3")), dtype="bfloat16", num_kv_blocks=16)
    assert qwen3.engine.runner.decoder is None  # q/k norms
    fp16 = LLM(str(tiny_folder(tmp_path, "llama")), dtype="float16", num_kv_blocks=16)
    assert fp16.engine.runner.decoder is None
    off = LLM(str(tmp_path / "llama"), dtype="float32", num_kv_blocks=16, cpu_decoder=False)
    assert off.engine.runner.decoder is None and off.engine.runner.model.backend.paged_kernel is None


def test_the_build_folder_is_keyed_by_the_sources_and_their_place(tmp_path):
    """Two checkouts on one machine build into folders of their own, even of one version
    (torch's build.ninja names sources by path: sharing a folder, each would rebuild it
    after the other); a change to any source or header changes the key."""
    import shutil

    from tidal.model.cpu_extension import _CSRC, source_key

    copy = tmp_path / "csrc"
    shutil.copytree(_CSRC, copy)
    assert source_key(_CSRC) == source_key(_CSRC)
    before = source_key(copy)
    assert before != source_key(_CSRC)
    assert source_key(tmp_path / "." / "csrc") == before  # the place, however it is written
    header = copy / "tidal_cpu.h"
    header.write_text(header.read_text() + "\n// changed\n")
    assert source_key(copy) != before


def test_a_build_lock_left_by_a_killed_build_does_not_stall_the_next(tmp_path, monkeypatch):
    """torch waits forever on a `lock` file a killed build left; tidal's build folder drops
    it under an flock, which another process cannot take while a build holds it."""
    import fcntl

    from tidal.model.cpu_extension import _build_folder

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    with _build_folder() as folder:
        assert folder.parent == tmp_path
    (folder / "lock").write_text("")  # a build killed between taking and freeing torch's lock
    with _build_folder() as again:
        assert again == folder and not (folder / "lock").exists()
        with open(folder.parent / f"{folder.name}.flock") as other:
            with pytest.raises(BlockingIOError):
                fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
    with open(folder.parent / f"{folder.name}.flock") as other:
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)  # released with the build
