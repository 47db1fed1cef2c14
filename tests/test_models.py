"""Each supported architecture and RoPE schedule against transformers, on tiny random float32
models built here with HF's own config classes: tidal's greedy tokens equal HF's for 16
tokens, one request at a time and batched with chunked prefill and prefix-cache hits, and
the first step's logits agree to 1e-4; sliding windows shorter than the prompts; RoPE tables
equal HF's rotary modules'; configs tidal cannot run are refused at load time, naming the
architecture and what is missing."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from model_fixtures import SMALL, small_folder
from tidal import LLM, SamplingParams
from tidal.model import cpu_decode
from tidal.model.config import ModelArch, UnsupportedModelError
from tidal.model.rope import rope_tables

MAX_TOKENS = 16
LLAMA3 = dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
              high_freq_factor=4.0, original_max_position_embeddings=64)
LINEAR = dict(rope_type="linear", rope_theta=10000.0, factor=4.0)
DYNAMIC = dict(rope_type="dynamic", rope_theta=10000.0, factor=2.0)
YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=32)
PARTIAL = dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5)
LONGROPE = dict(rope_type="longrope", rope_theta=10000.0,
                short_factor=[1.0, 1.1, 1.2, 1.4, 1.8, 2.5, 3.0, 4.0],
                long_factor=[1.0, 1.5, 2.5, 4.0, 6.0, 9.0, 12.0, 16.0])
GEMMA3_ROPE = {"sliding_attention": dict(rope_type="default", rope_theta=10000.0),
               "full_attention": dict(rope_type="linear", rope_theta=1e6, factor=2.0)}
GRANITE = dict(embedding_multiplier=6.0, residual_multiplier=0.3, attention_multiplier=0.05,
               logits_scaling=4.0)
# name -> (model_type, config fields over SMALL's). Windows of 8 and 12 are shorter than
# most prompts; dynamic's 32 positions are fewer than most prompts plus their output.
CASES = {
    "llama": ("llama", {}),
    "llama-bias": ("llama", dict(attention_bias=True, mlp_bias=True)),
    "llama3": ("llama", dict(rope_parameters=LLAMA3)),
    "llama-linear": ("llama", dict(rope_parameters=LINEAR)),
    "llama-dynamic": ("llama", dict(max_position_embeddings=32, rope_parameters=DYNAMIC)),
    "llama-yarn": ("llama", dict(max_position_embeddings=128, rope_parameters=YARN)),
    "mistral-window": ("mistral", dict(sliding_window=8)),
    "qwen2": ("qwen2", {}),
    "qwen2-yarn-legacy": ("qwen2", dict(max_position_embeddings=128, rope_parameters=YARN)),
    "qwen2-layer-windows": ("qwen2", dict(use_sliding_window=True, sliding_window=8,
                                          max_window_layers=1)),
    "qwen3": ("qwen3", {}),
    "phi3-partial-window": ("phi3", dict(rope_parameters=PARTIAL, sliding_window=12)),
    # Prompts of 41 tokens cross the 32-token original context: both factor sets are used.
    "phi3-longrope": ("phi3", dict(max_position_embeddings=128,
                                   original_max_position_embeddings=32,
                                   rope_parameters=LONGROPE)),
    # Gemma untied: its tied head over these random embeddings repeats one token.
    "gemma2": ("gemma2", dict(sliding_window=8, query_pre_attn_scalar=24,
                              attn_logit_softcapping=4.0, final_logit_softcapping=3.0,
                              tie_word_embeddings=False)),
    "gemma3": ("gemma3_text", dict(sliding_window=8, rope_parameters=GEMMA3_ROPE,
                                   layer_types=["sliding_attention", "full_attention"],
                                   tie_word_embeddings=False)),
    # Granite's four scalars (folded into the weights at load), tied as its checkpoints are
    "granite": ("granite", dict(GRANITE, attention_bias=True, mlp_bias=True,
                                tie_word_embeddings=True)),
    "granite-untied": ("granite", dict(GRANITE, tie_word_embeddings=False)),
    # SmolLM3: its second layer without RoPE, and windowed where use_sliding_window is set
    "smollm3": ("smollm3", dict(no_rope_layer_interval=2, tie_word_embeddings=False)),
    "smollm3-window": ("smollm3", dict(no_rope_layers=[0, 1], use_sliding_window=True,
                                       sliding_window=8, tie_word_embeddings=False)),
    "mixtral": ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2)),
    # One MoE layer, one dense (mlp_only_layers); renormalised top-k.
    "qwen3-moe": ("qwen3_moe", dict(num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
                                    moe_intermediate_size=32, mlp_only_layers=[1])),
    "qwen2-moe-shared": ("qwen2_moe", dict(num_experts=8, num_experts_per_tok=3,
                                           moe_intermediate_size=32,
                                           shared_expert_intermediate_size=48)),
}
WINDOWED = ["mistral-window", "qwen2-layer-windows", "phi3-partial-window", "gemma2", "gemma3",
            "smollm3-window"]
INCREMENTAL = ("llama-dynamic", "phi3-longrope")  # schedules that depend on the length


def make_prompts() -> list[list[int]]:
    """Six prompts of 7 to 41 tokens; two share a 16-token (4-block) prefix."""
    gen = torch.Generator().manual_seed(1)

    def rand(n: int) -> list[int]:
        return torch.randint(3, SMALL["vocab_size"], (n,), generator=gen).tolist()

    shared = rand(16)
    return [rand(7), rand(19), shared + rand(17), rand(12), shared + rand(9), rand(41)]


PROMPTS = make_prompts()


def to_legacy(folder) -> None:
    """Rewrite config.json the pre-transformers-5 way: rope_theta + rope_scaling {type}."""
    path = folder / "config.json"
    cfg = json.loads(path.read_text())
    rope = cfg.pop("rope_parameters")
    cfg["rope_theta"] = rope.pop("rope_theta")
    rope["type"] = rope.pop("rope_type")
    cfg["rope_scaling"] = rope
    path.write_text(json.dumps(cfg))


def hf_run(model, ids: list[int], incremental: bool) -> tuple[list[int], torch.Tensor]:
    """HF's greedy tokens and first logits: recomputing the whole sequence each step, or
    (`incremental`) feeding one token at a time through its KV cache."""
    tokens, first, past, seq = [], None, None, list(ids)
    with torch.no_grad():
        if incremental:
            for t in ids:
                out = model(torch.tensor([[t]]), cache=past, use_cache=True)
                past = out.cache
        for _ in range(MAX_TOKENS):
            if not incremental:
                out = model(torch.tensor([seq]))
            logits = out.logits[0, -1]
            first = logits if first is None else first
            tokens.append(int(logits.argmax()))
            seq.append(tokens[-1])
            if incremental:
                out = model(torch.tensor([[tokens[-1]]]), cache=past, use_cache=True)
                past = out.cache
    return tokens, first


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    """A saved tiny model of one case and HF's reference tokens and first logits."""
    from transformers import AutoModelForCausalLM

    name = request.param
    family, config = CASES[name]
    folder = small_folder(tmp_path_factory.mktemp(name), name, family, **config)
    if name.endswith("legacy"):
        to_legacy(folder)
    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    # Dynamic NTK and LongRoPE: tidal gives position p the frequencies HF computes for p + 1
    # tokens, what HF's own token-by-token decoding uses (a whole-prompt HF prefill uses one
    # length).
    refs = [hf_run(hf, p, incremental=name in INCREMENTAL) for p in PROMPTS]
    return SimpleNamespace(name=name, folder=folder, tokens=[t for t, _ in refs],
                           logits=[lg for _, lg in refs])


def generate(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def test_one_at_a_time_with_first_step_logits(case):
    llm = LLM(str(case.folder), dtype="float32", num_kv_blocks=64, block_size=4)
    runner = llm.engine.runner
    assert (runner.decoder is not None) == cpu_decode.supports(runner.arch)  # C++ where it can
    logits, forward = [], runner._forward
    runner._forward = lambda batch: logits.append(forward(batch)[0]) or (logits[-1], None)
    for prompt, want, want_logits in zip(PROMPTS, case.tokens, case.logits):
        start = len(logits)
        assert generate(llm, [prompt]) == [want]
        assert logits[start].shape == (1, SMALL["vocab_size"])  # the whole prompt's step
        torch.testing.assert_close(logits[start][0], want_logits, atol=1e-4, rtol=0)


def test_batched_chunked_with_prefix_hits(case):
    llm = LLM(str(case.folder), dtype="float32", num_kv_blocks=128, block_size=4,
              chunked_prefill_size=8, max_input_tokens_per_step=24)
    assert generate(llm, PROMPTS) == case.tokens
    assert max(map(len, PROMPTS)) > 8  # so prompts were chunked
    hits = llm.engine.scheduler.prefix_hit_tokens
    assert generate(llm, PROMPTS[::-1]) == case.tokens[::-1]  # again: served from the cache
    assert llm.engine.scheduler.prefix_hit_tokens - hits >= sum(map(len, PROMPTS)) // 2


@pytest.mark.parametrize("name", WINDOWED)
def test_sliding_windows_on_the_pytorch_decode_paths(tmp_path, name):
    """Without the C++ decoder: single decodes take SDPA over the window's slice, batches the
    gathered bmm with the window masked. And the window matters: HF with full attention on
    the same weights generates other tokens."""
    from transformers import AutoConfig, AutoModelForCausalLM

    family, config = CASES[name]
    folder = small_folder(tmp_path, name, family, **config)
    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    want = [hf_run(hf, p, incremental=False)[0] for p in PROMPTS]
    arch = ModelArch.from_folder(folder)
    assert 0 < max(arch.windows) < max(map(len, PROMPTS))
    llm = LLM(str(folder), dtype="float32", num_kv_blocks=128, block_size=4, cpu_decoder=False,
              chunked_prefill_size=8, max_input_tokens_per_step=24)
    runner = llm.engine.runner
    assert runner.decoder is None and runner.model.backend.paged_kernel is None
    assert generate(llm, PROMPTS) == want
    assert [generate(llm, [p])[0] for p in PROMPTS[-2:]] == want[-2:]
    config = AutoConfig.from_pretrained(str(folder))
    config.sliding_window = 1 << 20  # longer than any sequence: full attention everywhere
    if getattr(config, "layer_types", None):
        config.layer_types = ["full_attention"] * config.num_hidden_layers
    full = AutoModelForCausalLM.from_pretrained(str(folder), config=config, dtype=torch.float32)
    assert [hf_run(full.eval(), p, incremental=False)[0] for p in PROMPTS] != want


# ---------------------------------------------------------------------- RoPE tables

@pytest.mark.parametrize("rope", [None, LLAMA3, LINEAR, DYNAMIC, YARN,
                                  dict(YARN, beta_fast=8, beta_slow=2, truncate=False),
                                  dict(YARN, attention_factor=0.8)],
                         ids=["default", "llama3", "linear", "dynamic", "yarn", "yarn-betas",
                              "yarn-attention-factor"])
def test_rope_tables_equal_transformers(rope):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    max_pos = 32 if rope is DYNAMIC else 128
    config = LlamaConfig(**{**SMALL, "max_position_embeddings": max_pos},
                         rope_parameters=rope or dict(rope_type="default", rope_theta=10000.0))
    arch = ModelArch.from_dict(config.to_dict())
    positions = arch.context_length
    cos, sin = rope_tables(arch.rope, positions)
    hf = LlamaRotaryEmbedding(config)
    x = torch.zeros(1)
    if rope is DYNAMIC:  # one token at a time: HF recomputes its base as the sequence grows
        rows = [hf(x, torch.tensor([[p]])) for p in range(positions)]
        want_cos, want_sin = (torch.cat([r[i][0] for r in rows]) for i in (0, 1))
    else:
        want_cos, want_sin = (t[0] for t in hf(x, torch.arange(positions)[None]))
    half = arch.head_dim // 2
    torch.testing.assert_close(cos, want_cos, atol=1e-6, rtol=0)
    torch.testing.assert_close(sin, torch.cat([-want_sin[:, :half], want_sin[:, half:]], -1),
                               atol=1e-6, rtol=0)
    default_cos = rope_tables(ModelArch.from_dict({**config.to_dict(), "rope_parameters": None,
                                                   "rope_theta": arch.rope.theta}).rope,
                              positions)[0]
    assert (rope is None) == torch.equal(cos, default_cos)  # a schedule changes the tables
    factor = {"linear": 4, "dynamic": 2}.get(arch.rope.kind, 1)
    assert positions == max_pos * factor  # linear and dynamic serve a stretched context


def test_partial_rotary_tables_equal_phi3():
    from transformers import Phi3Config
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    config = Phi3Config(**SMALL, rope_parameters=PARTIAL)
    arch = ModelArch.from_dict(config.to_dict())
    assert arch.rope.rotary_dim == arch.head_dim // 2 == 8
    cos, sin = rope_tables(arch.rope, 64)
    want_cos, want_sin = (t[0] for t in Phi3RotaryEmbedding(config)(torch.zeros(1),
                                                                    torch.arange(64)[None]))
    assert cos.shape == want_cos.shape == (64, 8)
    torch.testing.assert_close(cos, want_cos, atol=1e-6, rtol=0)
    torch.testing.assert_close(sin, torch.cat([-want_sin[:, :4], want_sin[:, 4:]], -1),
                               atol=1e-6, rtol=0)


def test_longrope_tables_equal_phi3_short_then_long():
    """Within the original context the short factors (HF on a short sequence), past it the
    long ones (HF on a long sequence), both scaled by the attention factor."""
    from transformers import Phi3Config
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    config = Phi3Config(**{**SMALL, "max_position_embeddings": 128},
                        original_max_position_embeddings=32, rope_parameters=LONGROPE)
    arch = ModelArch.from_dict(config.to_dict())
    cos, sin = rope_tables(arch.rope, 128)
    hf = Phi3RotaryEmbedding(config)
    short = [t[0] for t in hf(torch.zeros(1), torch.arange(32)[None])]
    long = [t[0] for t in hf(torch.zeros(1), torch.arange(128)[None])]
    for rows, (want_cos, want_sin) in ((slice(0, 32), short), (slice(32, 128), long)):
        torch.testing.assert_close(cos[rows], want_cos[rows], atol=1e-6, rtol=0)
        torch.testing.assert_close(sin[rows], torch.cat([-want_sin[rows, :8],
                                                          want_sin[rows, 8:]], -1),
                                   atol=1e-6, rtol=0)
    assert not torch.allclose(short[0][:32], long[0][:32])  # the two sets differ
    assert arch.rope.factor == 4.0 and cos[0, 0] > 1.0  # attention factor sqrt(1 + ln4/ln32)


# ---------------------------------------------------------------------- refused configs

def llama_config(**fields) -> dict:
    from transformers import LlamaConfig

    return {**LlamaConfig(**SMALL).to_dict(), **fields}


@pytest.mark.parametrize("cfg,expected", [
    ({"model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"],
      "n_routed_experts": 8},
     ["DeepseekV3ForCausalLM", "model_type 'deepseek_v3' is not supported",
      "mixture-of-experts layers (n_routed_experts) are not supported for this family"]),
    ({"model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"]},
     ["Gemma3ForConditionalGeneration", "text-only Gemma3ForCausalLM"]),
    ({"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "num_experts": 8},
     ["num_experts_per_tok is missing"]),
    ({"architectures": ["LlamaForTokenClassification"]},
     ["LlamaForTokenClassification is not supported"]),
    ({"num_experts": 8, "num_experts_per_tok": 2, "hidden_act": "relu"},
     ["mixture-of-experts layers (num_experts, num_experts_per_tok)", "hidden_act 'relu'"]),
    ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0]}},
     ["RoPE type 'longrope' needs short_factor and long_factor of 8 values each"]),
    ({"rope_scaling": {"type": "linear"}}, ["RoPE type 'linear' needs a 'factor'"]),
    ({"partial_rotary_factor": 0.5}, ["partial_rotary_factor=0.5", "LlamaForCausalLM"]),
    ({"quantization_config": {"quant_method": "fp8"}}, ["quantized checkpoints (fp8)"]),
    ({"quantization_config": {"quant_method": "awq", "bits": 8, "group_size": 256}},
     ["awq with 8 bits", "awq group_size 256"]),
    ({"quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": 128,
                              "checkpoint_format": "marlin"}}, ["checkpoint_format 'marlin'"]),
    ({"layer_types": ["full_attention", "chunked_attention"]}, ["chunked_attention"]),
    ({"model_type": "smollm3", "architectures": ["SmolLM3ForCausalLM"], "no_rope_layers": [1]},
     ["1 no_rope_layers for 2 layers"]),
    ({"model_type": "smollm3", "architectures": ["SmolLM3ForCausalLM"],
      "no_rope_layer_interval": 0}, ["no_rope_layer_interval must be a positive integer"]),
    ({"model_type": "granite", "architectures": ["GraniteForCausalLM"],
      "quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": 128}},
     ["quantized GraniteForCausalLM checkpoints are not supported"]),
    ({"rope_parameters": {"full_attention": {"rope_type": "default"}}}, ["per-layer RoPE"]),
])
def test_unsupported_configs_name_the_architecture_and_what_is_missing(cfg, expected):
    with pytest.raises(UnsupportedModelError) as err:
        ModelArch.from_dict(llama_config(**cfg), name="m")
    message = str(err.value)
    assert message.startswith("tidal cannot run m (")
    for part in expected:
        assert part in message


def test_smollm3_defaults_its_layers_without_rope_and_their_windows():
    """A SmolLM3 config.json without no_rope_layers or layer_types: every fourth layer
    rotates nothing (transformers' no_rope_layer_interval), and with use_sliding_window
    those layers alone are windowed."""
    cfg = dict(SMALL, model_type="smollm3", num_hidden_layers=8)
    arch = ModelArch.from_dict(cfg)
    assert arch.rope_layers == (True, True, True, False) * 2 and max(arch.windows) == 0
    windowed = ModelArch.from_dict(dict(cfg, use_sliding_window=True, sliding_window=8,
                                        no_rope_layer_interval=2))
    assert windowed.rope_layers == (True, False) * 4
    assert windowed.windows == (0, 8) * 4


def test_a_config_missing_a_shape_is_refused():
    cfg = llama_config()
    del cfg["num_attention_heads"]
    with pytest.raises(UnsupportedModelError, match="lacks 'num_attention_heads'"):
        ModelArch.from_dict(cfg)


@pytest.mark.parametrize("family", ["phimoe", "olmo2"])
def test_unsupported_models_fail_before_anything_loads(tmp_path, monkeypatch, family):
    """A saved transformers config (no weights needed): LLM refuses it by its
    architecture before a tokenizer, a model or a KV cache exists."""
    from transformers import AutoConfig

    arch = {"phimoe": "PhimoeForCausalLM", "olmo2": "Olmo2ForCausalLM"}[family]
    AutoConfig.for_model(family, architectures=[arch], **SMALL).save_pretrained(str(tmp_path))

    def never(*args, **kwargs):
        raise AssertionError("loading started")
    monkeypatch.setattr("tidal.engine.engine.Tokenizer", never)
    monkeypatch.setattr("tidal.engine.core.make_executor", never)
    with pytest.raises(UnsupportedModelError) as err:
        LLM(str(tmp_path), dtype="float32")
    assert f"tidal cannot run {tmp_path} ({arch})" in str(err.value)
    assert ("mixture-of-experts" in str(err.value)) == (family == "phimoe")
