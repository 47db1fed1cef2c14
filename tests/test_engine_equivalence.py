"""Greedy tokens equal HF transformers' (float32), one at a time, batched, chunked, under
retraction and with prefix-cache hits; for the embedded model and tiny Llama / Qwen3."""

from __future__ import annotations

import pytest
import torch

from model_fixtures import PROMPTS, embedded_folder, hf_greedy, tiny_folder
from tidal import LLM, SamplingParams

MAX_TOKENS = 12


@pytest.fixture(scope="module")
def embedded():
    """(folder, tokenized prompts, HF reference tokens) for the embedded model."""
    from transformers import AutoModelForCausalLM

    from tidal.model.registry import embedded_gguf

    gguf = embedded_gguf("smollm2-135m")
    # HF's own GGUF loader: an independent conversion of the same file.
    hf = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                              dtype=torch.float32).eval()
    llm = LLM("smollm2-135m", dtype="float32", num_kv_blocks=256)
    prompts = [llm.engine.tokenize(p) for p in PROMPTS]
    ref = [hf_greedy(hf, ids, MAX_TOKENS, eos=2) for ids in prompts]
    return llm, prompts, ref


def run(llm: LLM, prompts, ignore_eos=False):
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=ignore_eos)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def test_one_at_a_time(embedded):
    llm, prompts, ref = embedded
    assert [run(llm, [p])[0] for p in prompts] == ref


def test_batched(embedded):
    llm, prompts, ref = embedded
    assert run(llm, prompts) == ref


def test_chunked_prefill(embedded):
    _, prompts, ref = embedded
    llm = LLM(str(embedded_folder()), dtype="float32", num_kv_blocks=256, block_size=16,
              chunked_prefill_size=16, max_input_tokens_per_step=48)
    assert run(llm, prompts) == ref
    assert max(len(p) for p in prompts) > 16  # so at least one prompt was chunked


def test_retraction(embedded):
    _, prompts, ref = embedded
    # A pool this small with almost no decode reservation admits more than fits: retracts.
    llm = LLM(str(embedded_folder()), dtype="float32", num_kv_blocks=16, block_size=8,
              init_new_token_ratio=0.01)
    assert run(llm, prompts) == ref
    assert llm.engine.scheduler.num_preemptions > 0


def test_async_scheduling_under_retraction(embedded):
    """Step N+1 planned while step N runs: same tokens, and the preemption handshake (the
    typed ack, the dropped in-flight token) exercised on the real model."""
    _, prompts, ref = embedded
    llm = LLM(str(embedded_folder()), dtype="float32", num_kv_blocks=16, block_size=8,
              init_new_token_ratio=0.01, async_scheduling=True)
    assert run(llm, prompts) == ref
    assert llm.engine.scheduler.num_preemptions > 0
    assert run(llm, prompts[:1]) == ref[:1]  # and it goes on after draining
    assert not llm.engine.core.has_work() and llm.engine.scheduler.kv.pool.num_used == 0


def test_prefix_cache_hits(embedded):
    _, prompts, ref = embedded
    llm = LLM(str(embedded_folder()), dtype="float32", num_kv_blocks=256, block_size=4)
    assert run(llm, prompts) == ref
    assert run(llm, prompts[::-1]) == ref[::-1]  # the same prompts again: served from cache
    assert llm.engine.scheduler.prefix_hit_tokens > sum(len(p) for p in prompts) // 2


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_tiny_random_models(tmp_path, family):
    from transformers import AutoModelForCausalLM

    folder = tiny_folder(tmp_path, family)
    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    llm = LLM(str(folder), dtype="float32", num_kv_blocks=64, block_size=4,
              chunked_prefill_size=8, max_input_tokens_per_step=24)
    prompts = [llm.engine.tokenize(p) for p in PROMPTS]
    ref = [hf_greedy(hf, ids, MAX_TOKENS, eos=None) for ids in prompts]
    assert run(llm, prompts, ignore_eos=True) == ref
    assert [run(llm, [p], ignore_eos=True)[0] for p in prompts[:3]] == ref[:3]
