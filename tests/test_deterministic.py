"""--deterministic (batch-invariant inference): a request's tokens and logprobs are the same
bits alone, beside other requests, chunked, after a prefix-cache hit, preempted and
recomputed, speculated and under LoRA; served too. Without it they are not (the test of the
embedded model shows the default's difference, so the property is not vacuous)."""

from __future__ import annotations

import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lora_fixtures import make_adapter
from model_fixtures import small_folder, tiny_folder
from server_fixtures import module_server
from test_gguf_quants import weight_bytes
from tidal import LLM, SamplingParams
from tidal.engine.config import EngineConfig
from tidal.model import cpu_decode
from tidal.model.batch_invariant import FixedRows, check_supported
from tidal.model.gguf_quants import PANEL_ROWS, GGUFLinear, PromptRows, QuantizedWeight
from tidal.model.linear import PackedLinear

pytestmark = pytest.mark.skipif(cpu_decode.extension() is None,
                                reason="needs tidal's C++ extension")

TOKENS = 10


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("det")
    base = small_folder(tmp, "base", "llama", tie_word_embeddings=False)
    return base, make_adapter(base, tmp / "ad", 8, 16, ["q_proj", "v_proj", "down_proj"],
                              False, seed=1)


def engine(folder, adapter, dtype, **kw):
    return LLM(str(folder), **{**dict(dtype=dtype, num_kv_blocks=192, block_size=8,
                                      deterministic=True, max_loras=1,
                                      lora_modules=[f"ad={adapter}"]), **kw})


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def engines(request, folders):
    """A reference (no prefix cache, whole prompts, one at a time), and engines whose steps
    differ: small chunks; a pool so small that requests are retracted and recomputed, with a
    step planned while the last runs; ngram speculation."""
    base, adapter = folders
    dtype = request.param
    return dict(
        ref=engine(base, adapter, dtype, enable_prefix_caching=False),
        chunked=engine(base, adapter, dtype, chunked_prefill_size=8,
                       max_input_tokens_per_step=20),
        tight=engine(base, adapter, dtype, num_kv_blocks=14, init_new_token_ratio=0.01,
                     async_scheduling=True),
        spec=engine(base, adapter, dtype, speculative_method="ngram",
                    num_speculative_tokens=3, prompt_lookup_min=1,
                    speculative_adaptive=False))  # guesses every step, paying or not


def params(seed, lora):
    """Greedy, or sampled with a seed; the chosen token's logprob and the top 3 each."""
    kw = dict(temperature=0) if seed is None else dict(temperature=0.9, seed=seed)
    return SamplingParams(max_tokens=TOKENS, ignore_eos=True, logprobs=3,
                          lora="ad" if lora else None, **kw)


def answers(llm, prompts, p):
    outs = llm.generate([{"prompt_token_ids": q} for q in prompts], p, use_tqdm=False)
    return [(o.outputs[0].token_ids, [(t.logprob, t.top) for t in o.outputs[0].logprobs or []])
            for o in outs]


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_a_request_computes_the_same_bits_in_any_step(engines, data):
    draw = data.draw
    rng = random.Random(draw(st.integers(0, 2**32 - 1)))
    words = lambda n: [rng.randrange(3, 256) for _ in range(n)]  # noqa: E731
    # a repeating prompt gives the ngram proposer guesses to verify
    target = words(draw(st.integers(1, 40))) * draw(st.integers(1, 2))
    seed = draw(st.one_of(st.none(), st.integers(0, 1000)))
    p = params(seed, draw(st.booleans()))
    want = answers(engines["ref"], [target], p)[0]
    name = draw(st.sampled_from(["chunked", "tight", "spec"]))
    llm = engines[name]
    if draw(st.booleans()):  # a prefix of it cached first
        answers(llm, [target[:draw(st.integers(1, len(target)))]], p)
    others = [words(draw(st.integers(1, 50))) for _ in range(draw(st.integers(0, 4)))]
    at = draw(st.integers(0, len(others)))
    got = answers(llm, others[:at] + [target] + others[at:], p)[at]
    assert got == want, name


def test_those_steps_did_differ(engines):
    """(after the property) each engine did what it was made to: prefix hits, preemptions,
    accepted guesses"""
    p = params(None, False)
    answers(engines["tight"], [[5 + i] * 30 for i in range(6)], p)  # more than fits
    long = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
    answers(engines["spec"], [[7 + i, 8, 9] * 10 for i in range(4)], long)  # repeats itself
    twice = [answers(engines["chunked"], [list(range(10, 50))], p) for _ in range(2)]
    assert twice[0] == twice[1]
    assert engines["chunked"].engine.scheduler.prefix_hit_tokens > 0
    # decode-only steps ran in the C++ decoder, the others in PyTorch's ops
    assert all(llm.engine.runner.decoder is not None for llm in engines.values())
    assert engines["tight"].engine.scheduler.num_preemptions > 0
    assert engines["spec"].engine.scheduler.stats().spec_accepted_tokens > 0


@pytest.mark.parametrize("family, quantization, kv", [
    ("mistral", "none", "auto"), ("phi3", "none", "auto"), ("qwen3", "none", "auto"),
    ("llama", "int8", "auto"), ("llama", "int4", "auto"), ("llama", "none", "int8")])
def test_windows_qk_norms_and_quantized_layers_alike(tmp_path, family, quantization, kv):
    """Sliding windows of 6 (Mistral; Phi-3's partial rotary too), Qwen3's q/k norms,
    int8 and int4 projections, int8 KV: a prompt alone equals it chunked, batched and
    cached."""
    folder = tiny_folder(tmp_path, family)
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 49152) for _ in range(n)] for n in (37, 9, 60, 21)]
    p = params(None, False)
    kw = dict(dtype="float32", quantization=quantization, num_kv_blocks=128, block_size=8,
              kv_cache_dtype=kv, deterministic=True)
    alone = answers(LLM(str(folder), enable_prefix_caching=False, **kw), prompts[:1], p)[0]
    llm = LLM(str(folder), chunked_prefill_size=8, max_input_tokens_per_step=20, **kw)
    assert answers(llm, prompts, p)[0] == alone
    assert answers(llm, prompts[::-1], p)[-1] == alone  # its blocks cached now
    assert llm.engine.scheduler.prefix_hit_tokens > 0


def test_the_embedded_model_answers_the_same_cold_cached_and_batched():
    """The GGUF model in its own bits, prompts rounded twice: the default's first answer and
    its answer from the prefix cache differ in logprobs (the reason for the option)."""
    q = [{"role": "user", "content": "Explain in one paragraph how a hash map works."}]
    others = [[{"role": "user", "content": t}] for t in
              ("Write a haiku about the sea.", "List five prime numbers and say why.")]
    p = SamplingParams(max_tokens=24, temperature=0, logprobs=1)

    def three(llm):
        cold, cached = (llm.chat(q, p, use_tqdm=False)[0] for _ in range(2))
        batched = llm.chat([others[0], q, others[1]], p, use_tqdm=False)[1]
        return [[t.logprob for t in o.outputs[0].logprobs] for o in (cold, cached, batched)]

    kw = dict(num_kv_blocks=256, chunked_prefill_size=16, max_input_tokens_per_step=40)
    cold, cached, batched = three(LLM("smollm2-135m", deterministic=True, **kw))
    assert cold == cached == batched
    default = three(LLM("smollm2-135m", **kw))
    assert default[0] != default[1] or default[0] != default[2]


def test_fixed_rows_compute_a_row_alike_wherever_it_sits():
    torch.manual_seed(0)
    layer = FixedRows(PackedLinear(torch.randn(96, 1536)))
    x = torch.randn(40, 1536)
    whole = layer(x)
    for i in range(0, 40, 7):
        assert torch.equal(layer(x[i:i + 1])[0], whole[i])
        assert torch.equal(layer(x[i:])[0], whole[i])
    assert layer(x[:0]).shape == (0, 96)


@pytest.mark.parametrize("qtype, k", [(QT.Q8_0, 576), (QT.Q4_1, 576), (QT.Q6_K, 512),
                                      (QT.Q4_0, 1024), (QT.Q8_0, 1536)],
                         ids=lambda v: getattr(v, "name", str(v)))
def test_one_kernel_computes_a_gguf_row_alike_at_any_row_count(qtype, k):
    """Prompt rows rounded twice too (in_features a multiple of 512: on the int8 panels
    from 17 rows); the default crosses over to other kernels with the step's size, whose
    sums differ."""
    rng = np.random.default_rng(int(qtype))
    n = 48
    layer = GGUFLinear(QuantizedWeight("w", weight_bytes(qtype, n, k, rng), qtype, (n, k)))
    shared = PromptRows()
    layer.prompt_rows, layer.is_head = shared, False
    x = torch.randn(200, k)
    twice = torch.arange(0, 200, 3)
    shared.set(twice, 200, None, 0)
    default = layer(x)
    layer.one_kernel()
    assert layer.panel_rows == (PANEL_ROWS if k % 512 == 0 and qtype != QT.Q6_K and
                                cpu_decode.extension().gguf_int8_panels else 0)
    whole = layer(x)
    for i in range(0, 200, 9):
        shared.set(torch.tensor([0]) if i % 3 == 0 else None, 1, None, 0)
        assert torch.equal(layer(x[i:i + 1])[0], whole[i]), i
    assert not torch.equal(default, whole)


@pytest.mark.parametrize("kwargs, match", [
    (dict(tensor_parallel_size=2), "tensor-parallel"),
    (dict(speculative_method="ngram", num_speculative_tokens=3, speculative_branches=2),
     "speculative_branches"),
])
def test_what_it_does_not_cover_is_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig.from_kwargs(deterministic=True, **kwargs)


@pytest.mark.parametrize("arch, device, dtype, match", [
    (SimpleNamespace(moe=False, attn_softcap=0.0), "cuda", torch.float32, "CPU"),
    (SimpleNamespace(moe=False, attn_softcap=0.0), "cpu", torch.float16, "float16"),
    (SimpleNamespace(moe=True, attn_softcap=0.0), "cpu", torch.float32, "experts"),
    (SimpleNamespace(moe=False, attn_softcap=50.0), "cpu", torch.float32, "Gemma 2"),
])
def test_refusals_name_the_reason(arch, device, dtype, match):
    with pytest.raises(ValueError, match=match):
        check_supported(arch, device, dtype)


server, client = module_server("--deterministic", "--max-input-tokens-per-step", "48",
                               "--chunked-prefill-size", "24")


def test_served_answers_alone_and_among_concurrent_ones_are_the_same(server, client):
    from concurrent.futures import ThreadPoolExecutor

    def ask(text):
        out = client.chat.completions.create(
            model="smollm2-135m", messages=[{"role": "user", "content": text}], max_tokens=16,
            temperature=0, logprobs=True)
        return [(t.token, t.logprob) for t in out.choices[0].logprobs.content]

    q = "Name three uses of a hash map."
    alone = ask(q)
    texts = [q, "Tell me a long story about a lighthouse keeper.", "Count from one to ten.",
             "What is a B-tree?"]
    with ThreadPoolExecutor(4) as pool:
        together = list(pool.map(ask, texts))
    assert together[0] == alone
