"""Models served from a GGUF file's own bits (quantization 'gguf'): tiny Llama (tied head)
and Qwen2 (q/k/v biases) files whose fused projections mix formats (q/k in Q5_0 beside v in
Q8_0, as Q4_K_M files mix Q4_K and Q6_K) generate the greedy tokens of the same file run
dense in float32 (its weights dequantized), up to near-ties, with logprobs within the int8
rounding of the activations (the prompt's, rounded twice, within float rounding); the
projections, embedding and head hold the file's bytes, not floats; the C++ decoder runs them;
a file of ~50 MB loads within the RSS bound; 'auto' picks the file's own formats unless
the run asks for a float copy; and a request's tokens and logprobs do not depend on the
requests beside it (where the int8 panels run, bit for bit)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from model_fixtures import first_near_tie, small_folder
from test_gguf import CASES, hf_folder, write_gguf
from test_gguf_quants import EXT
from tidal import LLM, SamplingParams
from tidal.engine.config import ModelConfig
from tidal.engine.model_loading import effective_quantization
from tidal.model.gguf_quants import GGUFEmbedding, GGUFLinear

PROMPTS = [[3, 17, 99, 4, 5], [200, 100, 7], [9, 8, 7, 6, 5, 4, 3, 2, 1, 250, 251, 252, 253]]


def mixed(name: str) -> QT:
    """Per-tensor formats of a mixed file: v and down in Q8_0, the embedding in Q4_1."""
    if "attn_v" in name or "ffn_down" in name:
        return QT.Q8_0
    return QT.Q4_1 if "token_embd" in name else QT.Q5_0


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gguf-model")
    with pytest.MonkeyPatch.context() as env:  # the module's converted files, then unset
        env.setenv("TIDAL_CACHE", str(tmp / "cache"))
        yield {name: write_gguf(hf_folder(tmp, name), CASES[name][0], tmp / f"{name}.gguf",
                                qtype=mixed) for name in ("llama3", "qwen2")}


def run(path: Path, quantization: str, dtype: str, **options):
    llm = LLM(str(path), quantization=quantization, dtype=dtype, num_kv_blocks=64, block_size=4,
              **options)
    params = SamplingParams(max_tokens=10, temperature=0, logprobs=2, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    return llm, [o.outputs[0] for o in outs]


def test_prompt_rounding_once_rounds_a_prompt_as_ggml_does(files):
    """--prompt-rounding once: a prompt's rows are rounded to int8 once, as a generated
    token's; the first token's logprobs then miss the dense file's by int8's error."""
    llm, got = run(files["llama3"], "gguf", "float32", prompt_rounding="once")
    assert llm.engine.runner.model.prompt_rows is None
    _, want = run(files["llama3"], "none", "float32")
    first = [abs(g.logprobs[0].logprob - w.logprobs[0].logprob) for g, w in zip(got, want)]
    assert 1e-3 < max(first) < 0.05, first
    with pytest.raises(ValueError, match="prompt_rounding must be one of twice, once"):
        LLM(str(files["llama3"]), prompt_rounding="thrice")


@pytest.mark.parametrize("name", ["llama3", "qwen2"])
def test_own_formats_generate_the_dense_files_tokens(files, name):
    llm, got = run(files[name], "gguf", "float32")
    _, want = run(files[name], "none", "float32")
    for g, w in zip(got, want):
        # the same tokens up to the first where the dense file's top two lie within reach
        tie = first_near_tie(w)
        assert g.token_ids[:tie] == w.token_ids[:tie]
        diffs = [abs(a.logprob - b.logprob) for a, b in zip(g.logprobs, w.logprobs)][:tie + 1]
        assert max(diffs) < 0.05, diffs  # generated tokens' int8 activations: ~0.5% a projection
        # the prompt's rows are rounded twice (PromptRows): its next token's logprobs are
        # the dense file's to float rounding, not to int8's
        assert abs(g.logprobs[0].logprob - w.logprobs[0].logprob) < 1e-3, diffs
    runner = llm.engine.runner
    model = runner.model
    attn, mlp = model.layers[0].self_attn, model.layers[0].mlp
    assert isinstance(attn.qkv_proj, GGUFLinear) and isinstance(mlp.gate_up_proj, GGUFLinear)
    assert [w.qtype for w in attn.qkv_proj.parts] == [QT.Q5_0, QT.Q5_0, QT.Q8_0]
    assert isinstance(model.embed_tokens, GGUFEmbedding) and model.embed_tokens.table is None
    # the tied head multiplies the embedding's own blocks
    head = model.lm_head
    assert isinstance(head, GGUFLinear) and (name != "llama3" or
                                              head.parts[0] is model.embed_tokens.quantized)
    floats = sum(t.numel() for t in list(model.parameters()) + list(model.buffers())
                 if t.dtype.is_floating_point and t.dim() >= 2)
    assert floats <= 2 * runner.arch.context_length * runner.arch.head_dim  # the RoPE tables
    assert runner.decoder is not None or runner.device != "cpu"


@pytest.mark.parametrize("name", ["llama3", "qwen2"])
def test_bf16_activations_keep_the_tokens(files, name):
    _, got = run(files[name], "gguf", "bfloat16")
    _, want = run(files[name], "none", "float32")
    same = sum(g.token_ids == w.token_ids for g, w in zip(got, want))
    assert same >= 2, [(g.token_ids, w.token_ids) for g, w in zip(got, want)]


def test_auto_serves_a_gguf_in_its_own_formats_unless_a_float_run_asks():
    cpu = lambda **kw: effective_quantization(ModelConfig(**kw), "gguf", "cpu")  # noqa: E731
    assert cpu() == cpu(dtype="bfloat16") == cpu(quantization="gguf") == "gguf"
    assert cpu(dtype="float32") == cpu(dtype="float16") == cpu(load_format="dummy") == "none"
    assert cpu(quantization="int4") == "int4"
    assert effective_quantization(ModelConfig(), "gguf", "cuda") == "none"
    assert effective_quantization(ModelConfig(), "", "cpu") == "none"
    with pytest.raises(ValueError, match="runs gguf checkpoints"):
        effective_quantization(ModelConfig(quantization="gguf"), "", "cpu")
    with pytest.raises(ValueError, match="runs on CPU"):
        effective_quantization(ModelConfig(quantization="gguf"), "gguf", "cuda")
    with pytest.raises(ValueError, match="not float16"):
        effective_quantization(ModelConfig(quantization="gguf", dtype="float16"), "gguf", "cpu")
    with pytest.raises(ValueError, match="quantization must be one of"):
        ModelConfig(quantization="q4")


_RSS = """
import json, resource, sys
import torch
from tidal.model import cpu_decode
from tidal.model.config import ModelArch
from tidal.model.quantized_model import load_gguf_model
from tidal.model.registry import resolve_model
cpu_decode.extension()
arch = ModelArch.from_folder(resolve_model(sys.argv[1])[0])
def peak(): return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
base = peak()
model = load_gguf_model(sys.argv[1], arch, torch.bfloat16)
x = torch.randn(3, model.arch.hidden_size, dtype=torch.bfloat16)
for layer in model.layers:  # every weight read once
    layer.mlp(x); layer.self_attn.qkv_proj(x); layer.self_attn.o_proj(x)
model.lm_head(x)
print(json.dumps({"base": base, "peak": peak()}))
"""


def test_a_mid_size_file_loads_within_the_rss_bound(tmp_path):
    """Peak RSS of loading and running every weight of a ~50 MB Q4_0/Q8_0 file grows by at
    most the file's size plus 15% (the repacked planes replace the mapped pages they copy)."""
    from test_gguf import small_folder

    folder = small_folder(tmp_path, "mid", "llama", hidden_size=1024, intermediate_size=2816,
                          num_hidden_layers=6, num_attention_heads=16, num_key_value_heads=4,
                          head_dim=64, vocab_size=8192, tie_word_embeddings=False)
    kinds = lambda n: QT.Q8_0 if "attn_v" in n or "output" in n else QT.Q4_0  # noqa: E731
    path = write_gguf(folder, "llama", tmp_path / "mid.gguf", qtype=kinds)
    size = path.stat().st_size
    env = {**os.environ, "TIDAL_CACHE": str(tmp_path / "cache")}
    out = subprocess.run([sys.executable, "-c", _RSS, str(path)], capture_output=True,
                         text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    rss = json.loads(out.stdout.strip().splitlines()[-1])
    grown = rss["peak"] - rss["base"]
    assert size > 30e6 and grown <= 1.15 * size, (grown / 2**20, size / 2**20)
    assert np.isfinite(grown)


@pytest.mark.skipif(EXT is None or not EXT.gguf_int8_panels,
                    reason="needs the int8 panels (AVX-512 VNNI)")
def test_a_row_does_not_depend_on_its_batch(tmp_path):
    """24 requests together (steps of 24 rows: the int8 panels, AMX's or VNNI's; a prompt
    step of 48 rows rounded twice) give each request's greedy tokens and logprobs as it
    gives them alone (steps of 1-4 rows: the VNNI kernels), bit for bit: the same integer
    sums and float operations where in_features is a multiple of 512 (a file of 512-wide
    layers and a 1,024-wide MLP), where bf16 products (~0.3%) moved them apart. float32 KV:
    bf16 rows would round apart values that float32 rounding leaves apart where
    in_features is not such a multiple."""
    folder = small_folder(tmp_path, "wide", "llama", hidden_size=512, intermediate_size=1024,
                          num_attention_heads=8, num_key_value_heads=2, head_dim=64,
                          tie_word_embeddings=True)
    path = write_gguf(folder, "llama", tmp_path / "wide.gguf", qtype=mixed)
    llm = LLM(str(path), quantization="gguf", dtype="float32", num_kv_blocks=256,
              block_size=4, kv_cache_dtype="float32")
    params = SamplingParams(max_tokens=8, temperature=0, logprobs=2, ignore_eos=True)
    prompts = [{"prompt_token_ids": [3 + 7 * i % 250, 11 + 13 * i % 240]} for i in range(24)]
    together = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    for prompt, batched in zip(prompts, together):
        alone = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
        assert batched.token_ids == alone.token_ids
        assert [e.logprob for e in batched.logprobs] == [e.logprob for e in alone.logprobs]
