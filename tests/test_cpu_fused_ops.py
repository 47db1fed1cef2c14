"""The C++ extension's fused ops for the PyTorch path on CPU (residual add + RMSNorm; RoPE +
KV cache write; SiLU * up: csrc/fused_ops.cpp) against the eager ops they stand in for, over
every KV cache format, and a model's prompts with them against its prompts without."""

from __future__ import annotations

import shutil

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tidal.model import cpu_decode
from tidal.model.kv_quant import KVFormat
from tidal.model.linear import products
from tidal.model.llama import RMSNorm, apply_rope
from ulps import assert_close_ulps

ext = cpu_decode.extension()
pytestmark = pytest.mark.skipif(ext is None and shutil.which("c++") is None,
                                reason="no C++ compiler here")


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**16), tokens=st.integers(0, 40),
       hidden=st.sampled_from([64, 96, 576]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       scale=st.sampled_from([0.01, 1.0, 30.0]), residual=st.booleans(),
       bf16_x=st.booleans())
def test_norms_equal_llamas_rms_norm(seed, tokens, hidden, dtype, scale, residual, bf16_x):
    """The sum is the eager add's, bit for bit; the norm of it within two bf16 steps (the sum
    of squares runs in another order, which may move the normalised value one step before
    the weight, up to about 2 here, scales it), and the inputs are left as they were. x may
    be bf16 (a projection's products) under a float32 residual: added as its float32 copy."""
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(tokens, hidden, generator=gen) * scale).to(
        torch.bfloat16 if bf16_x and residual else dtype)
    res = (torch.randn(tokens, hidden, generator=gen) * scale).to(dtype)
    norm = RMSNorm(hidden, 1e-5).to(dtype)
    norm.weight.data.copy_(1 + 0.3 * torch.randn(hidden, generator=gen))
    x0, res0 = x.clone(), res.clone()
    if residual:
        got, got_sum = ext.fused_add_rms_norm(x, res, norm.weight.data, 1e-5)
        assert torch.equal(got_sum, x.to(dtype) + res)
        assert_close_ulps(got, norm(x.to(dtype) + res), ulps=2, tol=1e-5)
    else:
        assert_close_ulps(ext.rms_norm(x, norm.weight.data, 1e-5), norm(x), ulps=2, tol=1e-5)
    assert torch.equal(x, x0) and torch.equal(res, res0)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**16), tokens=st.integers(1, 40),
       heads=st.sampled_from([(2, 2), (6, 2), (9, 3)]), head_dim=st.sampled_from([16, 64]),
       partial=st.booleans(), dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       kv=st.sampled_from(["auto", "bfloat16", "int8", "fp8_e4m3"]), padding=st.booleans())
def test_rope_and_cache_equals_apply_rope_and_the_formats_write(seed, tokens, heads, head_dim,
                                                                partial, dtype, kv, padding):
    """q and k rotated in place in the qkv projection's output; k and v written at their
    slots as KVFormat.write writes them (slot -1: padding, nothing written), in every cache
    format; v left as it was."""
    h, hkv = heads
    gen = torch.Generator().manual_seed(seed)
    rot = head_dim // 2 if partial else head_dim
    qkv = torch.randn(tokens, h + 2 * hkv, head_dim, generator=gen).to(dtype)
    qk, v = qkv[:, :h + hkv], qkv[:, h + hkv:]
    positions = torch.randint(0, 4096, (tokens,), generator=gen).float()[:, None]
    freqs = positions * 10000.0 ** (-torch.arange(0, rot, 2) / rot)
    cos = torch.cat([freqs.cos(), freqs.cos()], -1).unsqueeze(1).to(dtype)
    sin = torch.cat([-freqs.sin(), freqs.sin()], -1).unsqueeze(1).to(dtype)
    fmt = KVFormat(kv)
    shape = fmt.cache_shape(-(-tokens // 8) + 2, 8, hkv, head_dim)
    k_cache = torch.zeros(shape, dtype=fmt.storage(dtype))
    v_cache = torch.zeros_like(k_cache)
    slots = torch.randperm(shape[0] * 8, generator=gen)[:tokens]
    if padding:
        slots[torch.rand(tokens, generator=gen) < 0.25] = -1
    want_qk, want_v = apply_rope(qk, (cos, sin)), v.clone()
    want_k_cache, want_v_cache = k_cache.clone(), v_cache.clone()
    kept = slots >= 0
    fmt.write(want_k_cache, slots[kept], want_qk[kept, h:])
    fmt.write(want_v_cache, slots[kept], v[kept])

    q, k = ext.rope_and_cache(qk, v, cos, sin, k_cache, v_cache, slots, h)
    assert q.data_ptr() == qkv.data_ptr() and k.shape == (tokens, hkv, head_dim)
    assert_close_ulps(qkv[:, :h + hkv], want_qk)
    assert torch.equal(qkv[:, h + hkv:], want_v)
    def raw(cache: torch.Tensor) -> torch.Tensor:  # a scale's bytes may read as NaN codes
        return cache.view(torch.uint8)

    assert torch.equal(raw(v_cache), raw(want_v_cache))  # the same values, coded alike
    if not fmt.quantized:  # bf16 rotates bit for bit; float32 may differ in a last bit
        assert_close_ulps(k_cache, want_k_cache)
    elif dtype == torch.bfloat16:
        assert torch.equal(raw(k_cache), raw(want_k_cache))
    else:  # a last bit apart may code a step apart
        want = fmt.decode(want_k_cache, torch.float32)
        torch.testing.assert_close(fmt.decode(k_cache, torch.float32), want, rtol=0,
                                   atol=want.abs().max().item() / 10)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**16), rows=st.integers(0, 40),
       inter=st.sampled_from([16, 40, 96, 1536]),
       types=st.sampled_from([(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                              (torch.bfloat16, torch.bfloat16)]))
def test_silu_mul_equals_the_eager_ops(seed, rows, inter, types):
    """SiLU(gate) * up from gate_up (a projection's output: float32, or bf16 tiles' products
    under a float32 model) bit for bit as MLP.forward computes it from gate_up converted to
    the model's dtype, at any width (ATen's SiLU takes a row's tail with a scalar exp)."""
    given_type, model_type = types
    gen = torch.Generator().manual_seed(seed)
    gate_up = (torch.randn(rows, 2 * inter, generator=gen) * 4).to(given_type)
    gate, up = gate_up.to(model_type).chunk(2, dim=-1)
    got = ext.silu_mul(gate_up, model_type)
    assert got.dtype == model_type and torch.equal(got, torch.nn.functional.silu(gate) * up)


def test_the_ops_refuse_what_does_not_fit():
    cache = torch.zeros(2, 4, 2, 16)
    cos = torch.ones(3, 1, 16)
    qk, v, slots = torch.zeros(3, 6, 16), torch.zeros(3, 2, 16), torch.zeros(3, dtype=torch.long)
    with pytest.raises(ValueError, match="do not match the caches"):
        ext.rope_and_cache(torch.zeros(3, 7, 16), v, cos, cos, cache, cache, slots, 4)
    with pytest.raises(ValueError, match="RoPE tables of 17 dims"):
        ext.rope_and_cache(qk, v, torch.ones(3, 1, 17), torch.ones(3, 1, 17), cache, cache,
                           slots, 4)
    with pytest.raises(ValueError, match="slot 8 is not in the cache"):
        ext.rope_and_cache(qk, v, cos, cos, cache, cache, slots + 8, 4)
    assert not cache.any()  # refused before anything was written
    with pytest.raises(ValueError, match="does not match x"):  # bf16 x under float32 only
        ext.fused_add_rms_norm(qk, qk.bfloat16(), torch.ones(16, dtype=torch.bfloat16), 1e-6)
    with pytest.raises(ValueError, match="RMSNorm weight"):
        ext.rms_norm(qk, torch.ones(16, dtype=torch.bfloat16), 1e-6)
    with pytest.raises(ValueError, match="gate_up must be"):
        ext.silu_mul(torch.zeros(3, 7), torch.float32)


@pytest.mark.parametrize("family,dtype,kv", [("llama", "float32", "auto"),
                                             ("phi3", "bfloat16", "int8"),
                                             ("qwen3", "float32", "auto")])
def test_prompts_with_the_fused_ops_equal_prompts_without(tmp_path, family, dtype, kv):
    """A batch of prompts of several lengths (chunked, and over a cached prefix): every
    prompt position's logprobs and the greedy tokens match the eager ops' (q/k norms in
    qwen3, half-head rotary and a 6-token window in phi3, int8 KV rows)."""
    from model_fixtures import first_near_tie, tiny_folder
    from tidal import LLM, SamplingParams

    folder = str(tiny_folder(tmp_path, family))
    prefix = list(range(40, 60))
    prompts = [{"prompt_token_ids": prefix + list(range(5 + i, 12 + 5 * i))} for i in range(6)]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, prompt_logprobs=1,
                            logprobs=2)
    runs = []
    for fused in (True, False):
        llm = LLM(folder, dtype=dtype, num_kv_blocks=256, block_size=4, kv_cache_dtype=kv,
                  max_input_tokens_per_step=48)
        model = llm.engine.runner.model
        assert model.kernels is not None and model.kernels.rope_and_cache is ext.rope_and_cache
        if not fused:
            model.kernels = None
        runs.append(llm.generate(prompts, params, use_tqdm=False))
    tol = 1e-4 if dtype == "float32" else 0.05
    for fused, eager in zip(*runs):
        got = [e.logprob for e in fused.prompt_logprobs[1:]]
        want = [e.logprob for e in eager.prompt_logprobs[1:]]
        assert got == pytest.approx(want, abs=tol)
        n = min(first_near_tie(fused.outputs[0]), first_near_tie(eager.outputs[0])) + 1
        assert fused.outputs[0].token_ids[:n] == eager.outputs[0].token_ids[:n]


def test_a_gguf_files_bf16_products_give_the_eager_ops_logprobs(tmp_path, monkeypatch):
    """Every step on bf16 tiles (as a CPU with AMX multiplies long prompts): the fused ops
    read gate/up's, down's and o's products in bf16 as the eager ops read their float32
    copy (a mixed file of Q5_0 and Q8_0 projections, a q/k/v bias)."""
    import gguf

    from model_fixtures import first_near_tie
    from test_gguf import CASES, hf_folder, write_gguf
    from tidal import LLM, SamplingParams

    for name in ("MAX_ROWS", "NIBBLE_MAX_ROWS", "AMX_MAX_ROWS", "K_AMX_MAX_ROWS",
                 "VNNI_PANELS_MAX_ROWS", "PANELS_MAX_ROWS"):
        monkeypatch.setattr(f"tidal.model.gguf_quants.{name}", 0)
    monkeypatch.setattr("tidal.model.gguf_quants.TILE_BF16", True)
    monkeypatch.setenv("TIDAL_CACHE", str(tmp_path / "cache"))
    qtype = lambda name: gguf.GGMLQuantizationType.Q8_0 if "ffn" in name else \
        gguf.GGMLQuantizationType.Q5_0  # noqa: E731
    path = write_gguf(hf_folder(tmp_path, "qwen2"), CASES["qwen2"][0], tmp_path / "q.gguf",
                      qtype=qtype)
    prompts = [{"prompt_token_ids": [3 + (7 * i + j) % 250 for j in range(5 + 4 * i)]}
               for i in range(4)]
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, prompt_logprobs=1,
                            logprobs=2)
    runs = []
    for fused in (True, False):
        llm = LLM(str(path), quantization="gguf", dtype="float32", num_kv_blocks=64,
                  block_size=4)
        model = llm.engine.runner.model
        mlp = model.layers[0].mlp
        assert model.kernels is not None and mlp.gate_up_proj.max_rows == 0
        assert products(mlp.down_proj, torch.ones(3, mlp.down_proj.in_features)).dtype == \
            torch.bfloat16  # what the fused norm after it reads
        if not fused:
            model.kernels = None
        runs.append(llm.generate(prompts, params, use_tqdm=False))
    for fused, eager in zip(*runs):
        got = [e.logprob for e in fused.prompt_logprobs[1:]]
        assert got == pytest.approx([e.logprob for e in eager.prompt_logprobs[1:]], abs=1e-4)
        n = min(first_near_tie(fused.outputs[0]), first_near_tie(eager.outputs[0])) + 1
        assert fused.outputs[0].token_ids[:n] == eager.outputs[0].token_ids[:n]
