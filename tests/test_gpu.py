"""The GPU path on a real device (`pytest -m gpu`; skipped without CUDA): CUDA-graph decode
equals eager decode, sampling options work on device tensors, and a decode step never
synchronises the host with the stream (its one wait is an event after the tokens' copy).

Dummy weights of SmolLM2's and a small Llama's shapes, so the tests need no files."""

from __future__ import annotations

import json

import pytest
import torch

from tidal import LLM, SamplingParams
from tidal.bench.word_tokenizer import save_word_tokenizer
from tidal.sim.profiles import MODEL_CONFIGS

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

SHAPES = {
    "smollm2": MODEL_CONFIGS["smollm2-135m"],
    "llama": dict(MODEL_CONFIGS["llama-3-8b"], hidden_size=1024, intermediate_size=3584,
                  num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
                  vocab_size=32000, bos_token_id=1, eos_token_id=2),
    "mixtral": dict(model_type="mixtral", hidden_size=512, intermediate_size=1024,
                    num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
                    num_local_experts=8, num_experts_per_tok=2, vocab_size=32000,
                    max_position_embeddings=4096, rms_norm_eps=1e-5, rope_theta=1e6,
                    tie_word_embeddings=False, bos_token_id=1, eos_token_id=2),
}


def folder_of(tmp_path, name: str):
    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(SHAPES[name]))
    save_word_tokenizer(folder, SHAPES[name]["vocab_size"])
    return folder


def llm(folder, **kw) -> LLM:
    torch.manual_seed(0)  # dummy weights: the same in every engine of a test
    return LLM(str(folder), load_format="dummy", device="cuda", dtype="bfloat16",
               num_kv_blocks=256, max_num_seqs=8, **kw)


def prompts(count: int, vocab: int) -> list[dict]:
    gen = torch.Generator().manual_seed(1)
    return [{"prompt_token_ids": torch.randint(10, vocab, (12 + 7 * i,), generator=gen).tolist()}
            for i in range(count)]


@pytest.mark.parametrize("name", ["smollm2", "llama", "mixtral"])
def test_graph_decode_equals_eager_decode_for_256_steps(tmp_path, name):
    """Four sequences (a bucket's size, so eager and graph steps multiply the same shapes),
    contexts under 512 tokens (one attention split either way): the same greedy tokens.
    The MoE's grouped experts have no host sync, so its decodes are captured too."""
    folder = folder_of(tmp_path, name)
    params = SamplingParams(max_tokens=256, temperature=0, ignore_eos=True)
    batch = prompts(4, SHAPES[name]["vocab_size"])
    eager = llm(folder, enforce_eager=True)
    assert eager.engine.runner.graphs is None
    want = [o.outputs[0].token_ids for o in eager.generate(batch, params, use_tqdm=False)]
    del eager
    graphs = llm(folder)
    got = [o.outputs[0].token_ids for o in graphs.generate(batch, params, use_tqdm=False)]
    assert graphs.engine.runner.graphs.replays >= 250
    assert got == want


def test_sampling_options_run_on_the_device(tmp_path):
    folder = folder_of(tmp_path, "smollm2")
    engine = llm(folder)
    batch = prompts(3, SHAPES["smollm2"]["vocab_size"])
    seeded = SamplingParams(max_tokens=24, temperature=1.0, top_p=0.9, seed=11, logprobs=3,
                            presence_penalty=0.5, frequency_penalty=0.2,
                            repetition_penalty=1.1, ignore_eos=True)
    other = SamplingParams(max_tokens=24, temperature=0.7, top_k=20, min_p=0.05,
                           ignore_eos=True)
    alone = engine.generate(batch[:1], seeded, use_tqdm=False)[0].outputs[0]
    mixed = engine.generate(batch, [seeded, other, other], use_tqdm=False)[0].outputs[0]
    assert mixed.token_ids == alone.token_ids  # a seed reproduces in any batch
    assert len(alone.logprobs) == 24
    for e in alone.logprobs:  # the token's logprob, the top 3 as (token, logprob)
        assert e.logprob <= 0 and len(e.top) == 3
        assert [v for _, v in e.top] == sorted((v for _, v in e.top), reverse=True)


@pytest.mark.parametrize("enforce_eager", [True, False])
def test_a_decode_step_does_not_sync_the_stream(tmp_path, enforce_eager):
    folder = folder_of(tmp_path, "smollm2")
    engine = llm(folder, enforce_eager=enforce_eager).engine
    params = SamplingParams(max_tokens=8, temperature=1.0, top_p=0.9, seed=3, logprobs=2,
                            ignore_eos=True)
    for p in prompts(3, SHAPES["smollm2"]["vocab_size"]):
        engine.add_request(p["prompt_token_ids"], params)
    for _ in range(3):  # prefills, then decodes
        engine.step()
    torch.cuda.set_sync_debug_mode("error")
    try:
        engine.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert all(engine.runner.seqs[r].output for r in engine.runner.seqs)


def test_gpu_memory_utilization_sizes_the_kv_cache(tmp_path):
    """The process stays under its share of the device, and the KV cache takes most of what
    the weights (~0.1 GB), activations, graphs and earlier tests' engines leave."""
    folder = folder_of(tmp_path, "llama")
    before = torch.cuda.memory_allocated()
    engine = LLM(str(folder), load_format="dummy", device="cuda", gpu_memory_utilization=0.5)
    total = torch.cuda.mem_get_info()[1]
    assert torch.cuda.memory_reserved() <= 0.52 * total
    assert engine.engine.executor.info.kv_cache_bytes >= 0.5 * total - before - 4 * 2**30
