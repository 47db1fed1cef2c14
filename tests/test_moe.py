"""Routed experts (tidal.model.mlp.SparseMoE) against transformers' own MoE blocks, on tiny
random float32 models: equal outputs for batches in which some experts receive no token,
each busy expert run once a step over all its tokens (no per-token loop), the packed bf16
layers the CPU runner swaps in computing the same block, and so the grouped experts (torch's
grouped matmul, tidal's C++ kernel over panels at decode sizes, BLAS per expert past
them)."""

from __future__ import annotations

import pytest
import torch

from model_fixtures import small_folder
from tidal.model.linear import PackedLinear, can_pack, replace_linears
from tidal.model.loader import load_model
from tidal.model import cpu_decode
from tidal.model.mlp import SparseMoE, pack_panels

CASES = {
    "mixtral": ("mixtral", dict(num_local_experts=8, num_experts_per_tok=2)),
    "qwen2_moe": ("qwen2_moe", dict(num_experts=8, num_experts_per_tok=2,
                                    moe_intermediate_size=32,
                                    shared_expert_intermediate_size=48)),
    "qwen3_moe": ("qwen3_moe", dict(num_experts=8, num_experts_per_tok=3,
                                    moe_intermediate_size=32, norm_topk_prob=True)),
}


@pytest.fixture(scope="module", params=list(CASES))
def pair(request, tmp_path_factory):
    """(tidal's first MoE block, transformers' first MoE block) of one saved tiny model."""
    from transformers import AutoModelForCausalLM

    family, config = CASES[request.param]
    folder = small_folder(tmp_path_factory.mktemp(family), family, family, **config)
    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    ours = load_model(folder, torch.float32)
    return ours.layers[0].mlp, hf.model.layers[0].mlp


def expert_calls(block: SparseMoE) -> list[int]:
    """Rows each expert's forward receives, appended as it runs."""
    calls = []
    for i, expert in enumerate(block.experts):
        expert.register_forward_hook(lambda m, args, out, i=i: calls.append((i, len(args[0]))))
    return calls


@pytest.mark.parametrize("tokens", [1, 3, 40])
def test_equals_transformers_with_idle_experts(pair, tokens):
    ours, hf = pair
    assert isinstance(ours, SparseMoE)
    torch.manual_seed(tokens)
    x = torch.randn(tokens, ours.gate.in_features)
    calls = expert_calls(ours)
    with torch.no_grad():
        got, want = ours(x), hf(x[None])
    want = want[0] if isinstance(want, tuple) else want
    torch.testing.assert_close(got, want[0], atol=1e-5, rtol=1e-5)
    _, chosen = ours.route(x)
    busy = chosen.unique().tolist()
    if tokens <= 3:  # at most 3 x 3 picks of 8 experts: some get none
        assert len(busy) < len(ours.experts)
    assert sorted(i for i, _ in calls) == busy  # each busy expert once, the idle ones never
    assert sum(n for _, n in calls) == tokens * ours.top_k  # every (token, expert) pair once


@pytest.mark.skipif(not can_pack(torch.bfloat16, "cpu"), reason="no oneDNN bf16 packing here")
def test_packed_bf16_experts_compute_the_same_block(pair):
    """The CPU runner's bf16 layers (PackedLinear, bounded row counts) under the experts:
    the block's output equals the same bf16 weights through plain linears."""
    import copy

    ours, _ = pair
    plain = copy.deepcopy(ours).to(torch.bfloat16)
    packed = replace_linears(copy.deepcopy(plain), PackedLinear, fp32_rows=1 << 30)
    assert all(isinstance(e.gate_up_proj, PackedLinear) for e in packed.experts)
    x = torch.randn(37, ours.gate.in_features).to(torch.bfloat16)
    with torch.no_grad():
        torch.testing.assert_close(packed(x).float(), plain(x).float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("kernel", ["torch", "c++", "c++ bf16"])
def test_grouped_experts_compute_the_same_block(pair, kernel):
    """Grouped, the block equals its expert loop; with bf16 panels, the loop over the same
    bf16-rounded weights (the kernel widens them exactly and computes in float32)."""
    import copy

    ours, _ = pair
    ext = cpu_decode.extension() if kernel != "torch" else None
    if kernel != "torch" and ext is None:
        pytest.skip("tidal's C++ extension does not build here")
    dtype = torch.bfloat16 if kernel.endswith("bf16") else torch.float32
    ours = copy.deepcopy(ours)
    for expert in ours.experts:
        for p in expert.parameters():
            p.data = p.data.to(dtype).float()
    grouped = copy.deepcopy(ours)
    grouped.group_experts(dtype, kernel=ext and ext.grouped_linear)
    assert grouped.w_gate_up.dtype == dtype and len(grouped.experts) == 0
    assert (grouped.kernel is not None) == (ext is not None)
    for tokens in (1, 3, 40, 300):  # 300 x k rows is past the kernel's decode sizes
        torch.manual_seed(tokens)
        x = torch.randn(tokens, ours.gate.in_features)
        with torch.no_grad():
            torch.testing.assert_close(grouped(x), ours(x), atol=1e-5, rtol=1e-5)
    with torch.no_grad():  # an expert the router never picks, at both sizes
        for block in (ours, grouped):
            block.gate.weight[0] = -1e3  # with positive inputs: the lowest logit
        for tokens in (3, 300):
            x = torch.randn(tokens, ours.gate.in_features).abs()
            assert 0 not in ours.route(x)[1]
            torch.testing.assert_close(grouped(x), ours(x), atol=1e-5, rtol=1e-5)


def test_panels_hold_each_experts_columns_in_blocks_of_16():
    w = torch.arange(2 * 3 * 32, dtype=torch.float32).view(2, 3, 32)
    p = pack_panels(w)
    assert p.shape == (2, 2, 3, 16)
    for e, panel, k, j in ((0, 0, 0, 0), (1, 1, 2, 15), (0, 1, 1, 3)):
        assert p[e, panel, k, j] == w[e, k, panel * 16 + j]


def test_the_cost_model_counts_active_experts_and_the_ones_a_step_reads():
    """Mixtral-8x7B's published sizes (46.7B parameters, 12.9B active with embeddings); a
    one-token decode reads a quarter of the experts (top 2 of 8), a large batch all of them,
    so its memory-bound step costs more than a dense model of the active size."""
    from transformers import AutoConfig

    from tidal.model.config import ModelArch
    from tidal.sim.cost_model import CostModel
    from tidal.sim.profiles import hardware, linear_params, weight_params
    from tidal.core.step_time import StepShape

    arch = ModelArch.from_dict(AutoConfig.for_model("mixtral").to_dict())
    embed = arch.vocab_size * arch.hidden_size
    assert weight_params(arch) / 1e9 == pytest.approx(46.7, abs=0.05)
    assert (linear_params(arch) + 2 * embed) / 1e9 == pytest.approx(12.9, abs=0.05)
    model, hw = CostModel(arch, hardware("h100")), hardware("h100")
    bandwidth = hw.mem_bandwidth * hw.bandwidth_efficiency
    one, many = (model.roofline(StepShape().add(1, 0, count=n)) for n in (1, 64))
    dense_active = (linear_params(arch) + embed) * hw.dtype_bytes / bandwidth
    assert one == pytest.approx(dense_active, rel=0.01)  # 2 of 8 experts: what a token uses
    assert many > 3 * one  # 64 tokens touch (nearly) all eight
