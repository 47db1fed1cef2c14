"""LoRA adapters over a GGUF base, the default serving path: a tiny Llama file whose fused
projections mix formats, served in its own bits (quantization 'gguf', the integer kernels,
with and without the C++ decoder) with an adapter on every projection, computes what the same
file run dense in float32 with the same adapter computes (the dense path's LoRA equals PEFT's
merged model: `test_lora.py`): each greedy token's logprob within the int8 rounding of the
activations, the same tokens up to a near tie of the dense run (the tiny model's next-token
distributions are nearly flat), and the same prompt logprobs. The adapter moves the logprobs
far past that bound, so it is really applied."""

from __future__ import annotations

import pytest

from test_gguf import CASES, hf_folder, write_gguf
from test_gguf_model import PROMPTS, mixed
from test_lora import make_adapter
from tidal import LLM, SamplingParams
from tidal.model.gguf_quants import GGUFLinear

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lora-gguf")
    with pytest.MonkeyPatch.context() as env:  # the module's converted files, then unset
        env.setenv("TIDAL_CACHE", str(tmp / "cache"))
        hf = hf_folder(tmp, "llama3")
        gguf = write_gguf(hf, CASES["llama3"][0], tmp / "llama3.gguf", qtype=mixed)
        yield gguf, make_adapter(hf, tmp / "adapter", 8, 16, TARGETS, False, seed=3)


BOUND = 0.05  # int8 activations: ~0.5% of each projection
LONG = [(7 * i + 3) % 250 + 3 for i in range(40)]


def run(path, adapter, quantization: str, cpu_decoder: bool = True):
    """(the LLM, by adapter (None: the base): each prompt's greedy output with the top 2
    logprobs, and LONG's prompt logprobs)."""
    llm = LLM(str(path), quantization=quantization, dtype="float32", num_kv_blocks=64,
              block_size=4, max_loras=1, lora_modules=[f"it={adapter}"],
              cpu_decoder=cpu_decoder)
    outs = {}
    for lora in (None, "it"):
        params = SamplingParams(max_tokens=10, temperature=0, logprobs=2, ignore_eos=True,
                                lora=lora)
        got = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
        scored = llm.generate([{"prompt_token_ids": LONG}], SamplingParams(
            max_tokens=1, prompt_logprobs=1, temperature=0, lora=lora), use_tqdm=False)[0]
        outs[lora] = [o.outputs[0] for o in got], [e.logprob for e in scored.prompt_logprobs[1:]]
    return llm, outs


def agree(got, want) -> None:
    """Greedy runs agree: each token's logprob within BOUND while the tokens are the same;
    where they part, the dense run's two likeliest were within 2 BOUND (a near tie)."""
    for g, w in zip(got, want):
        for a, b, ta, tb in zip(g.logprobs, w.logprobs, g.token_ids, w.token_ids):
            if ta != tb:
                (_, first), (_, second) = b.top[:2]
                assert first - second < 2 * BOUND, (g.token_ids, w.token_ids)
                break
            assert abs(a.logprob - b.logprob) < BOUND


@pytest.mark.parametrize("cpu_decoder", [True, False])
def test_an_adapter_over_the_files_own_bits_equals_it_over_the_dense_file(files,
                                                                          cpu_decoder):
    gguf, adapter = files
    llm, got = run(gguf, adapter, "gguf", cpu_decoder)
    _, want = run(gguf, adapter, "none")
    for lora in (None, "it"):
        agree(got[lora][0], want[lora][0])
        prompt = [abs(a - b) for a, b in zip(got[lora][1], want[lora][1])]
        assert max(prompt) < BOUND, prompt
    moved = [abs(a - b) for a, b in zip(got["it"][1], got[None][1])]
    assert max(moved) > 4 * BOUND  # the adapter is applied
    runner = llm.engine.runner
    assert isinstance(runner.model.layers[0].self_attn.qkv_proj.base, GGUFLinear)
    assert (runner.decoder is not None) == cpu_decoder
