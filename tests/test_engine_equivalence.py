"""Greedy tokens equal HF transformers' (float32), one at a time, batched, chunked, under
retraction and with prefix-cache hits; for the embedded model and tiny Llama / Qwen3."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

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


def test_steps_split_into_forward_passes(embedded):
    """max_forward_tokens: a step over the limit runs as several passes; same tokens."""
    _, prompts, ref = embedded
    llm = LLM(str(embedded_folder()), dtype="float32", num_kv_blocks=256, max_forward_tokens=24)
    runner = llm.engine.runner
    steps, passes = [], []
    execute, forward = runner.execute, runner._forward
    runner.execute = lambda out: steps.append(out) or execute(out)
    runner._forward = lambda batch: passes.append(len(batch.input_ids)) or forward(batch)
    assert run(llm, prompts) == ref
    assert len(passes) > len(steps) and max(passes) <= max(24, *map(len, prompts))


@settings(max_examples=200)
@given(sizes=st.lists(st.one_of(st.just(1), st.integers(2, 50)), max_size=30),
       limit=st.integers(0, 60))
def test_forward_passes_keep_every_entry_under_the_limit(sizes, limit):
    from types import SimpleNamespace

    from tidal.core import ScheduledRequest
    from tidal.engine.batch import BatchBuilder

    entries = [ScheduledRequest(str(i), n, 0, [], True, n > 1) for i, n in enumerate(sizes)]
    passes = BatchBuilder.passes(SimpleNamespace(max_forward_tokens=limit), entries)
    flat = [s for p in passes for s in p]
    prefills = [s for s in entries if s.is_prefill]
    assert sorted(map(id, flat)) == sorted(map(id, entries))  # each entry exactly once
    if len(passes) > 1:  # split: prefills in their order, then the decodes
        assert [s for s in flat if s.is_prefill] == prefills
        decode = [not s.is_prefill for s in flat]
        assert decode == sorted(decode)
    assert all(p for p in passes) or passes == [[]]
    for p in passes:
        tokens = sum(s.num_new_tokens for s in p)
        assert limit == 0 or tokens <= limit or len(p) == 1
    if limit == 0 or sum(sizes) <= limit:
        assert passes == [entries]


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
