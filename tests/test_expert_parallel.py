"""Mixture-of-experts models over two CPU ranks (tidal/model/tensor_parallel.py,
tidal/model/mlp.py): attention split by heads as for a dense model, and the routed experts
either split by rows like a dense MLP or, with expert parallelism, held whole, half on each
rank. Either way a rank's experts block gives a partial sum that one all-reduce completes,
so two ranks give one process's greedy tokens and its logprobs within float32 rounding, for
Mixtral and Qwen2-MoE (its shared expert split by rows) in float32 and a Qwen3-MoE GGUF in
its own bits; a rank never reads another rank's experts; sizes that do not divide are
refused naming the flag."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as QT

from model_fixtures import small_folder

from tidal import LLM, SamplingParams
from tidal.model.mlp import SparseMoE
from tidal.model.tensor_parallel import RowParallel

PROMPTS = [[5, 9, 33, 7, 100, 3], [17, 4, 200, 8], [60, 61, 62, 60, 61, 62, 60, 61]]
LOGPROB_BOUND = 1e-4  # float32 sums in another order
QUANTIZED_BOUND = 0.05  # the int8 rounding of the activations (test_tensor_parallel.py)
PARAMS = SamplingParams(max_tokens=12, temperature=0.0, logprobs=2, ignore_eos=True)

CASES = {
    "mixtral": ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2)),
    "qwen2_moe": ("qwen2_moe", dict(num_experts=4, num_experts_per_tok=2,
                                    moe_intermediate_size=32,
                                    shared_expert_intermediate_size=48)),
}


def generate(llm: LLM) -> list:
    return [r.outputs[0] for r in llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                                               PARAMS)]


def rank0_block(llm: LLM) -> SparseMoE:
    mlp = llm.engine.executor.worker.model.layers[0].mlp
    assert isinstance(mlp, RowParallel)  # the block's output summed over the ranks
    return mlp.linear


def assert_same(one: list, two: list, bound: float) -> None:
    assert [o.token_ids for o in two] == [o.token_ids for o in one]
    for a, b in zip(one, two):
        for x, y in zip(a.logprobs, b.logprobs):
            assert abs(x.logprob - y.logprob) < bound


def expert_bytes(block: SparseMoE) -> int:
    """The routed experts' weight bytes (as loaded, or stacked for grouped matmuls)."""
    return sum(p.numel() * p.element_size() for n, p in block.named_parameters()
               if n.startswith(("experts.", "w_gate_up", "w_down")))


@pytest.mark.parametrize("name", list(CASES))
def test_two_ranks_split_the_experts_by_rows_or_whole_and_give_one_process_tokens(
        tmp_path, name):
    family, config = CASES[name]
    folder = small_folder(tmp_path, name, family, seed=3, **config)
    options = dict(num_kv_blocks=64, num_threads=1, dtype="float32")
    one = LLM(str(folder), **options)
    try:
        want = generate(one)
        whole = one.engine.runner.model.layers[0].mlp
        spec, held = one.engine.runner.model.arch.moe, expert_bytes(whole)
    finally:
        one.close()
    for expert_parallel in (False, True):
        two = LLM(str(folder), tensor_parallel_size=2, enable_expert_parallel=expert_parallel,
                  **options)
        try:
            assert_same(want, generate(two), LOGPROB_BOUND)
            block = rank0_block(two)
            part = two.engine.executor.worker.model.arch.moe
            assert expert_bytes(block) * 2 == held
            if expert_parallel:  # half the experts, whole
                assert (part.held, block.first_expert) == (spec.num_experts // 2, 0)
                assert part.intermediate_size == spec.intermediate_size
            else:  # every expert, half its rows
                assert part.held == spec.num_experts
                assert part.intermediate_size * 2 == spec.intermediate_size
            if block.shared_expert is not None:
                assert part.shared_intermediate_size * 2 == spec.shared_intermediate_size
        finally:
            two.close()


def test_a_moe_ggufs_experts_split_whole_in_their_own_bits(tmp_path, monkeypatch):
    """Qwen3-MoE in a GGUF, experts in Q8_0: with expert parallelism rank 0 holds experts
    0-1 as the file stores them (the file's bytes, never floats) and never reads 2-3."""
    from test_gguf import hf_folder, write_gguf

    from tidal.model.gguf_quants import GGUFLinear

    monkeypatch.setenv("TIDAL_CACHE", str(tmp_path / "cache"))
    path = write_gguf(hf_folder(tmp_path, "qwen3_moe"), "qwen3moe", tmp_path / "moe.gguf",
                      qtype=lambda name: QT.Q8_0 if "exps" in name else QT.F32)
    one = LLM(str(path), num_kv_blocks=64, num_threads=1)
    two = LLM(str(path), tensor_parallel_size=2, enable_expert_parallel=True,
              num_kv_blocks=64, num_threads=1)
    try:
        assert_same(generate(one), generate(two), QUANTIZED_BOUND)
        whole, block = one.engine.runner.model.layers[0].mlp, rank0_block(two)
        assert len(block.experts) * 2 == len(whole.experts) == 4
        for mine, same in zip(block.experts, whole.experts):  # experts 0 and 1, byte for byte
            part, full = mine.down_proj, same.down_proj
            assert isinstance(part, GGUFLinear) and part.parts[0].qtype == QT.Q8_0
            assert torch.equal(part.parts[0].data, full.parts[0].data)
    finally:
        one.close()
        two.close()


def test_expert_sizes_that_do_not_split_are_refused_naming_the_flag(tmp_path):
    six = small_folder(tmp_path, "six", "mixtral", num_local_experts=6, num_experts_per_tok=2)
    with pytest.raises(ValueError, match=r"--tensor-parallel-size 4 does not divide the "
                                         r"model's 6 routed experts \(--enable-expert-parallel"):
        LLM(str(six), tensor_parallel_size=4, enable_expert_parallel=True, num_kv_blocks=16)
    odd = small_folder(tmp_path, "odd", "qwen2_moe", num_experts=4, num_experts_per_tok=2,
                       moe_intermediate_size=33)
    with pytest.raises(ValueError, match=r"--tensor-parallel-size 2 does not divide the "
                                         r"model's 33 expert intermediate size .*"
                                         r"--enable-expert-parallel"):
        LLM(str(odd), tensor_parallel_size=2, num_kv_blocks=16)
