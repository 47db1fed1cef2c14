"""Decode graphs without CUDA: the EagerReplay capture backend replays a bucket's step over
the same static inputs a CUDA graph would read, so bucketing, padding and the null block are
checked on CPU; the GPU tests (test_gpu.py) replay real graphs."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from model_fixtures import PROMPTS, tiny_folder
from tidal import LLM, SamplingParams
from tidal.engine.decode_graphs import EagerReplay, graph_buckets
from tidal.engine.device import core_device
from tidal.engine.step_inputs import StepInputs
from tidal.model import cpu_decode


@given(st.integers(1, 600))
def test_every_batch_size_has_the_smallest_bucket_that_holds_it(max_seqs):
    buckets = graph_buckets(max_seqs)
    assert buckets == sorted(set(buckets)) and buckets[-1] == max_seqs
    for n in range(1, max_seqs + 1):
        b = next(b for b in buckets if b >= n)
        assert b - n <= max(n // 2, 1) + 16  # padding stays bounded


def test_buckets_follow_the_documented_sizes():
    assert graph_buckets(256) == [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256]
    assert graph_buckets(40) == [1, 2, 4, 8, 16, 24, 32, 40]
    assert graph_buckets(1) == [1]


def test_step_inputs_reuse_their_buffers_and_grow():
    inputs = StepInputs("cpu")
    a = inputs.put("ids", [3, 1, 4])
    assert a.tolist() == [3, 1, 4] and a.dtype == torch.long
    b = inputs.put("ids", [5, 9])
    assert b.data_ptr() == a.data_ptr()  # the same buffer, refilled
    tables = inputs.put("tables", [1, 2, 3, 4, 5, 6], width=3)
    assert tables.tolist() == [[1, 2, 3], [4, 5, 6]]
    big = inputs.put("ids", list(range(1000)))
    assert big.tolist() == list(range(1000))


def test_data_parallel_cores_take_one_gpu_each(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert [core_device("auto", i) for i in range(6)] == [
        "cuda:0", "cuda:1", "cuda:2", "cuda:3", "cuda:0", "cuda:1"]
    assert core_device("cpu", 3) == "cpu" and core_device("cuda:2", 0) == "cuda:2"
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert core_device("auto", 3) == "auto"


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    if cpu_decode.extension() is None:
        pytest.skip("the C++ paged kernel needs a compiler")
    return tiny_folder(tmp_path_factory.mktemp("tiny"), "llama")


def _generate(folder, graphs: bool, prompts):
    """Greedy tokens of the prompts decoding through the paged kernel (the C++ one: the
    whole-model decoder off), with or without graphs; the blocks the steps were given."""
    llm = LLM(str(folder), dtype="float32", num_kv_blocks=96, block_size=4, max_num_seqs=8)
    runner = llm.engine.runner
    runner.decoder = None
    if graphs:
        runner.use_decode_graphs(EagerReplay(), max_num_seqs=8, max_model_len=128)
    used: set[int] = set()
    execute = runner.execute

    def record(out):
        used.update(b for s in out.scheduled for b in s.block_ids)
        return execute(out)
    runner.execute = record
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": llm.engine.tokenize(p)} for p in prompts], params,
                        use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], runner, used


@pytest.mark.parametrize("count", [3, 5])
def test_graph_steps_equal_eager_steps_and_padding_writes_only_the_null_block(folder, count):
    prompts = PROMPTS[:count]
    want, _, _ = _generate(folder, False, prompts)
    got, runner, used = _generate(folder, True, prompts)
    assert got == want
    assert runner.graphs.replays >= 15  # the decode steps ran through the buckets
    written = {b for b in range(runner.num_blocks + 1)
               if any(k[b].abs().sum() > 0 for k, _ in runner.kv_caches)}
    assert runner.null_block in written  # 3 and 5 decodes pad to buckets 4 and 8
    assert written - {runner.null_block} <= used


def test_the_gpu_kv_budget_is_what_the_share_leaves(monkeypatch):
    """utilization x total, less the profiled peak (weights + activations) and what other
    processes hold: the device's numbers stubbed, the profile really run."""
    from tidal.engine import device as dev

    gib = 2**30
    ran = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda d=None: None)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda d=None: None)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda d=None: 20 * gib)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda d=None: 22 * gib)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d=None: (50 * gib, 80 * gib))
    budget = dev.gpu_kv_budget("cuda", 0.9, lambda: ran.append(1))
    assert ran == [1]
    # 72 GiB allowed - 20 peak - (80 - 50 - 22 = 8 held by other processes)
    assert budget == int(0.9 * 80 * gib) - 20 * gib - 8 * gib
