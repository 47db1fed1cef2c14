"""Quantized and bf16 KV (`--kv-cache-dtype int8|fp8_e4m3|bfloat16`, and `auto`'s bf16 rows
for own formats on AMX): rows decode within half a code step (bf16: torch's rounding, from
the C++ decoder too); the ten architectures' logprobs drift within stated bounds of float
KV; the pool holds the tokens the bytes allow (float32 rows refused under a bf16 model);
block I/O keeps formats apart; the embedded model's perplexity on real text stays within 1%
of float KV."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from model_fixtures import small_folder
from test_models import CASES, PROMPTS
from tidal import LLM, SamplingParams
from tidal.engine.config import KV_CACHE_DTYPES
from tidal.engine.kv_cache import KVCache
from tidal.model.config import ModelArch
from tidal.model.kv_quant import CODES, FLOATS, SCALE_STEPS, KVFormat


def test_the_config_offers_the_formats_the_cache_has():
    assert set(KV_CACHE_DTYPES) == {"auto", *FLOATS, *CODES}
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        LLM("smollm2-135m", kv_cache_dtype="int4")


@settings(max_examples=80, deadline=None)
@given(seed=st.integers(0, 2**16), rows=st.integers(1, 9), d=st.sampled_from([8, 16, 64]),
       magnitude=st.sampled_from([1e-6, 1e-2, 1.0, 300.0]), name=st.sampled_from(list(CODES)),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_a_row_decodes_within_half_a_code_step(seed, rows, d, magnitude, name, dtype):
    fmt = KVFormat(name)
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, 2, d, generator=gen) * magnitude).to(dtype)
    x[0, 0] = 0  # an all-zero row: scale 0, decoded exactly
    coded = fmt.encode(x)
    back = fmt.decode(coded, torch.float32)
    amax = x.float().abs().amax(-1, keepdim=True)
    step = coded[..., d:].contiguous().view(torch.float16).float() / SCALE_STEPS  # as stored
    exact = amax / fmt.qmax
    # float16's 11 significant bits where the stored count is normal (max|x| above ~3e-5 for
    # int8), its absolute step below that
    normal = exact * SCALE_STEPS >= 2.0 ** -14
    assert ((step - exact).abs() <= exact * 2.0 ** -11)[normal].all()
    assert ((step - exact).abs() <= 2.0 ** -25 / SCALE_STEPS)[~normal].all()
    clamped = (amax - fmt.qmax * step).clamp(min=0)  # a scale rounded down clamps the largest
    if name == "int8":  # uniform steps of the stored scale
        bound = torch.maximum(step / 2, clamped) * 1.001
    else:  # 3 mantissa bits: half a step is 1/16 of the value, or of e4m3's subnormal step
        bound = torch.maximum(torch.maximum(x.float().abs() / 16, step * 2.0 ** -10),
                              clamped) * 1.001
    assert ((back - x.float()).abs() <= bound).all()
    assert (back[0, 0] == 0).all()


@pytest.mark.parametrize("cpu_decoder", [True, False])
def test_bf16_rows_are_torchs_rounding_of_the_float32_rows(tmp_path, cpu_decoder):
    """A float32 model's first layer writes the same K and V under either format (nothing
    before it reads the cache): the bf16 rows, written by the C++ decoder or by PyTorch,
    are torch's round-to-nearest-even of the float32 ones, bit for bit."""
    folder = small_folder(tmp_path, "llama", "llama")
    layer0 = {}
    for kv in ("auto", "bfloat16"):
        llm = LLM(str(folder), dtype="float32", num_kv_blocks=16, block_size=4,
                  kv_cache_dtype=kv, cpu_decoder=cpu_decoder)
        llm.generate([{"prompt_token_ids": PROMPTS[0]}],
                     SamplingParams(max_tokens=4, temperature=0, ignore_eos=True),
                     use_tqdm=False)
        assert llm.engine.runner.decoder is not None or not cpu_decoder
        layer0[kv] = [c.clone() for c in llm.engine.runner.kv.layers[0]]
        llm.close()
    for want, got in zip(*layer0.values()):
        assert got.dtype == torch.bfloat16 and want.dtype == torch.float32
        assert want.abs().sum() > 0  # rows were written
        assert torch.equal(got.view(torch.int16), want.to(torch.bfloat16).view(torch.int16))


# One case of each family, float32 weights; each prompt's greedy continuation under float
# KV is scored again, token by token through 8-token chunks that read the cache, under each
# format. Bounds: the mean drift of those tokens' logprobs, and the share of positions whose
# likeliest token stays the same (these random models' flat distributions are full of
# near-ties: real models drift less, see the perplexity test).
FAMILIES = ["llama", "mistral-window", "qwen2", "qwen3", "phi3-partial-window", "gemma2",
            "gemma3", "mixtral", "qwen3-moe", "qwen2-moe-shared"]
BOUNDS = {"int8": (0.05, 0.9), "fp8_e4m3": (0.25, 0.7),  # mean |d logprob|, top-1 agreement
          "bfloat16": (0.03, 0.93)}


def scored(folder, kv: str, seqs: list[list[int]]):
    llm = LLM(str(folder), dtype="float32", num_kv_blocks=128, block_size=4,
              chunked_prefill_size=8, max_input_tokens_per_step=8, kv_cache_dtype=kv)
    outs = llm.generate([{"prompt_token_ids": s} for s in seqs],
                        SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0),
                        use_tqdm=False)
    llm.close()
    return [o.prompt_logprobs for o in outs]


@pytest.mark.parametrize("name", FAMILIES)
def test_logprobs_drift_within_bounds_on_each_family(tmp_path, name):
    family, config = CASES[name]
    folder = small_folder(tmp_path, name, family, **config)
    llm = LLM(str(folder), dtype="float32", num_kv_blocks=128, block_size=4)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                        SamplingParams(max_tokens=16, temperature=0, ignore_eos=True),
                        use_tqdm=False)
    llm.close()
    seqs = [p + o.outputs[0].token_ids for p, o in zip(PROMPTS, outs)]
    want = scored(folder, "auto", seqs)
    for kv, (drift, agreement) in BOUNDS.items():
        got = scored(folder, kv, seqs)
        pairs = [(w[i], g[i]) for p, w, g in zip(PROMPTS, want, got)
                 for i in range(len(p), len(p) + 16)]
        mean = sum(abs(w.logprob - g.logprob) for w, g in pairs) / len(pairs)
        same = sum((w.rank == 1) == (g.rank == 1) for w, g in pairs) / len(pairs)
        assert 0 < mean <= drift and same >= agreement, (kv, mean, same)


def test_auto_is_bf16_rows_for_own_formats_on_bf16_cpus(monkeypatch):
    """`auto` resolves to bf16 rows for weights in their own formats (float32 activations)
    on a CPU with AMX or AVX512-BF16, and to the model's dtype otherwise; an explicit format
    stays."""
    from tidal.engine import device

    f32 = torch.float32
    for flags, quantization, dtype, want in [
            ({"amx_bf16"}, "gguf", f32, "bfloat16"), ({"amx_bf16"}, "awq", f32, "bfloat16"),
            ({"avx512_bf16"}, "gguf", f32, "bfloat16"), ({"avx2"}, "gguf", f32, "auto"),
            ({"amx_bf16"}, "none", f32, "auto"), ({"amx_bf16"}, "gguf", torch.bfloat16, "auto")]:
        monkeypatch.setattr(device, "cpu_flags", lambda: flags)
        assert device.pick_kv_cache_dtype("auto", "cpu", quantization, dtype) == want
    assert device.pick_kv_cache_dtype("auto", "cuda", "gguf", f32) == "auto"
    assert device.pick_kv_cache_dtype("float32", "cpu", "gguf", f32) == "float32"


def test_the_pool_holds_the_tokens_its_bytes_allow(tmp_path):
    folder = small_folder(tmp_path, "llama", "llama")
    arch = ModelArch.from_folder(folder)
    blocks = {}
    row_bytes = {"auto": 64, "bfloat16": 32, "float32": 64}  # rows of 16 values, float32 model
    for kv in KV_CACHE_DTYPES:
        # bf16 rows of 16 values: 32 bytes; coded: 16 codes and a 2-byte scale; float32: 64
        assert KVFormat(kv).bytes_per_token(arch, torch.float32) == (
            2 * arch.num_layers * arch.num_kv_heads * row_bytes.get(kv, 18))
        if kv == "float32":  # more than a bf16 model's values hold: refused
            with pytest.raises(ValueError, match="--kv-cache-dtype float32 holds more"):
                LLM(str(folder), dtype="bfloat16", kv_cache_dtype=kv)
            continue
        llm = LLM(str(folder), dtype="bfloat16", kv_cache_memory=2**22, block_size=16,
                  kv_cache_dtype=kv)
        blocks[kv] = llm.engine.runner.kv.num_blocks
        assert KVFormat(kv).bytes_per_token(arch, torch.bfloat16) == (
            2 * arch.num_layers * arch.num_kv_heads * (18 if kv in CODES else 32))
        llm.close()
    assert blocks["bfloat16"] == blocks["auto"]  # a bf16 model's own dtype
    for kv in CODES:  # head_dim 16: 32 / 18 = 1.78x; the embedded model's 64: 128 / 66
        assert blocks[kv] >= 1.75 * blocks["auto"]


def test_block_io_moves_codes_and_scales_and_keeps_formats_apart():
    arch = ModelArch.from_dict(dict(model_type="llama", vocab_size=64, hidden_size=32,
                                    intermediate_size=64, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2))
    gen = torch.Generator().manual_seed(0)
    caches = {kv: KVCache(arch, 6, 4, torch.float32, "cpu", KVFormat(kv))
              for kv in KV_CACHE_DTYPES}
    for kv, cache in caches.items():
        fmt = cache.format
        for k, v in cache.layers:
            for c in (k, v):
                fmt.write(c, torch.arange(24), torch.randn(24, arch.num_kv_heads,
                                                           arch.head_dim, generator=gen))
    src = caches["int8"]
    message = src.read_blocks([1, 3])
    twin = KVCache(arch, 6, 4, torch.float32, "cpu", KVFormat("int8"))
    twin.write_blocks([0, 5], *message)
    for (k, _), (k2, _) in zip(src.layers, twin.layers):
        assert torch.equal(k[1], k2[0]) and torch.equal(k[3], k2[5])
    for other in ("auto", "bfloat16", "fp8_e4m3"):  # fp8: int8's shape, refused by dtype
        with pytest.raises(ValueError, match="kv-cache-dtype"):
            caches[other].write_blocks([0, 1], *message)
    for cache in caches.values():  # the disk tier's bytes, a speculation tree's slot moves
        data = cache.block_bytes([2])[0]
        assert len(data) == cache.block_nbytes
        cache.write_rows([4], torch.frombuffer(bytearray(data), dtype=torch.uint8)[None])
        cache.move_slots([8, 9, 21], [0, 1, 6])  # slot 21: block 5, position 1
        for k, _ in cache.layers:
            assert torch.equal(k[4].view(torch.uint8), k[2].view(torch.uint8))
            assert torch.equal(k[0, :2].view(torch.uint8), k[2, :2].view(torch.uint8))
            assert torch.equal(k[1, 2].view(torch.uint8), k[5, 1].view(torch.uint8))


def test_perplexity_on_real_text_stays_within_one_percent_of_float_kv():
    """The embedded model on ShareGPT replies (benchmarks/perplexity.py's text and scoring),
    4 chunks of 512 tokens in 64-token steps: later steps attend over the cached KV."""
    from tidal.bench.perplexity import chunks, sharegpt_text, tidal_perplexity
    from tidal.model.registry import resolve_model
    from tidal.model.tokenizer import Tokenizer

    try:
        folder = resolve_model("smollm2-135m")[0]
        text = sharegpt_text(512 * 4 * 6)
    except FileNotFoundError as exc:
        pytest.skip(f"the embedded model or the ShareGPT text is missing: {exc}")
    prompts = chunks(Tokenizer(folder), text, 512, 4)
    ppl = {kv: tidal_perplexity("smollm2-135m", "auto", "auto", prompts, 512, kv, chunk=64)[0]
           for kv in KV_CACHE_DTYPES}
    assert all(math.isfinite(p) and 2 < p < 50 for p in ppl.values())
    for kv in KV_CACHE_DTYPES:
        assert abs(ppl[kv] / ppl["auto"] - 1) <= 0.01, ppl


@pytest.mark.parametrize("cached, length, name, low", [
    (0, 256, "bfloat16", True), (0, 255, "bfloat16", False), (0, 256, "float32", False),
    (40, 256, "bfloat16", True), (2016, 32, "bfloat16", True), (2016, 31, "bfloat16", False),
    (0, 256, "int8", True), (2016, 32, "int8", True), (2016, 31, "fp8_e4m3", False)])
def test_large_prompt_runs_over_bf16_rows_attend_in_bf16(cached, length, name, low):
    """A float32 model's prompt run whose attention takes BF16_ATTENTION_SCORES scores a head
    or more (its tokens times its context) over a bf16 KV cache, or a quantized one on a CPU
    with AMX, attends in bf16: K and V as the cache holds them (a cached prefix's, and its
    own after one; a fresh run's own rounded to bf16), the queries rounded alike. A smaller
    run, and any run over a float32 cache, attends in float32: over its own float32 K and
    V, or, after a cached prefix, over the context as the cache holds it."""
    import torch.nn.functional as F

    from tidal.model.attention import (BF16_ATTENTION_SCORES, BF16_OVER_CODES,
                                       AttentionMetadata, PrefillSeq, TorchAttention,
                                       prefix_causal_mask)
    assert (length * (cached + length) >= BF16_ATTENTION_SCORES) == low or name == "float32"
    low = low and (name == "bfloat16" or BF16_OVER_CODES)
    h, hkv, d, bs = 4, 2, 16, 16
    gen = torch.Generator().manual_seed(cached + length)
    kv = KVFormat(name)
    total = cached + length
    blocks = math.ceil(total / bs)
    k_cache, v_cache = (torch.zeros(kv.cache_shape(blocks, bs, hkv, d),
                                    dtype=kv.storage(torch.float32)) for _ in range(2))
    q = torch.randn(length, h, d, generator=gen)
    k_all, v_all = (torch.randn(total, hkv, d, generator=gen) for _ in range(2))
    prefix = torch.arange(cached)
    kv.write(k_cache, prefix, k_all[:cached])
    kv.write(v_cache, prefix, v_all[:cached])
    seq = (PrefillSeq(0, length, 0) if not cached else
           PrefillSeq(0, length, cached, torch.arange(blocks),
                      prefix_causal_mask(cached, length, "cpu")))
    meta = AttentionMetadata(torch.arange(cached, total), [seq], length)
    got = TorchAttention(h, hkv, d, kv=kv).forward(q, k_all[cached:], v_all[cached:],
                                                   k_cache, v_cache, meta)

    def held(t):  # K or V as the cache holds it
        return kv.decode(kv.encode(t), torch.float32) if kv.quantized else t.to(
            kv.storage(torch.float32))

    def sdpa(dtype, stored):
        ks, vs = ((held(t) if stored else t).to(dtype).transpose(0, 1) for t in (k_all, v_all))
        return F.scaled_dot_product_attention(
            q.to(dtype).transpose(0, 1)[None], ks[None], vs[None],
            attn_mask=None if not cached else seq.mask, is_causal=not cached,
            enable_gqa=True)[0].transpose(0, 1).float()
    want = sdpa(torch.bfloat16 if low else torch.float32, bool(cached))
    assert got.dtype == torch.float32 and torch.equal(got, want)
    if low:  # bf16 attention is observably not float32's
        assert not torch.equal(got, sdpa(torch.float32, bool(cached)))
