"""The simulator's tensor parallelism: a replica split over devices as tidal splits a model
(tidal/sim/cost_model.py, tidal/sim/build.py)."""

from __future__ import annotations

import pytest

from tidal.model.config import part_arch
from tidal.sim.build import build_simulator
from tidal.sim.cost_model import CostModel, StepShape
from tidal.sim.profiles import Hardware, kv_blocks_for, model_arch

ARCH = model_arch("llama-3-8b")


def test_tensor_parallel_ranks_split_the_weights_and_kv_and_pay_their_collectives():
    """A rank of a split Llama-3-8B reads half the weights (the embedding and head split by
    vocabulary too) and holds more than twice the KV blocks; each step adds two all-reduces
    a layer and the embedding's, each its latency and its rows' bytes over the bandwidth,
    and a gather of the sampled rows' logits; a 70B fits no H100 alone, barely two, well four; what does
    not split is refused naming the flag."""
    free = Hardware("h100-free-links", 989e12, 3.35e12, 80e9)  # all-reduces cost nothing
    one, two = CostModel(ARCH, free), CostModel(part_arch(ARCH, 2), free, tp=2)
    decode = StepShape([(1, 100, True)] * 8)
    assert two.weight_bytes == pytest.approx(one.weight_bytes / 2, rel=0.01)
    assert two.roofline(decode) == pytest.approx(one.roofline(decode) / 2, rel=0.01)
    assert two.shape_time(decode) == pytest.approx(two.roofline(decode))
    slow = Hardware("h100-slow-links", 989e12, 3.35e12, 80e9, all_reduce_latency=1e-4,
                    all_reduce_bandwidth=1e9)
    added = CostModel(part_arch(ARCH, 2), slow, tp=2).shape_time(decode) - two.shape_time(decode)
    reduces = (2 * ARCH.num_layers + 1) * (1e-4 + 8 * ARCH.hidden_size * 2 / 1e9)
    gather = 1e-4 + 8 * ARCH.vocab_size * 4 / 1e9
    assert added == pytest.approx(reduces + gather)
    blocks = [kv_blocks_for(part_arch(ARCH, n), free, 16) for n in (1, 2)]
    assert blocks[1] > 2 * blocks[0]
    with pytest.raises(ValueError, match="no room for a KV cache"):
        build_simulator("llama-3-70b", "h100", {})
    kv = [build_simulator("llama-3-70b", "h100", {"tensor_parallel_size": n})[3].cache.num_blocks
          for n in (2, 4)]
    assert 0 < 10 * kv[0] < kv[1]  # two hold the weights (141 GB) and little else
    with pytest.raises(ValueError, match="--tensor-parallel-size 3 does not divide"):
        build_simulator("llama-3-8b", "h100", {"tensor_parallel_size": 3})


def test_experts_split_by_rows_or_whole_cost_a_rank_alike_on_average(tmp_path):
    """Mixtral-8x7B over two simulated ranks: experts split by rows (each rank all eight,
    half their rows) or whole (four each) store the same bytes a rank and, a token's top
    two landing on a rank's four experts one time in two, compute the same on average;
    whole experts wait for the busier rank; experts that do not divide are refused naming
    both flags."""
    import json

    from transformers import AutoConfig

    from tidal.model.config import ModelArch

    config = AutoConfig.for_model("mixtral").to_dict()
    arch = ModelArch.from_dict(config)
    free = Hardware("h100-free-links", 989e12, 3.35e12, 80e9)
    one = CostModel(arch, free)
    rows, whole = (CostModel(part_arch(arch, 2, ep), free, tp=2) for ep in (False, True))
    assert rows.arch.moe.held == 8 and whole.arch.moe.held == 4
    assert rows.expert_bytes == whole.expert_bytes == one.expert_bytes / 2
    assert rows.weight_bytes == pytest.approx(whole.weight_bytes)
    assert rows.linear_flops_per_token == pytest.approx(whole.linear_flops_per_token)
    decode = StepShape([(1, 100, True)] * 8)
    assert rows.roofline(decode) == pytest.approx(whole.roofline(decode))  # reading weights
    # A step waits for the rank its tokens picked most: rows split evenly, whole experts
    # by chance, the more evenly the more tokens (2 x 2,048 picks on two ranks: ~3% more)
    prompt = StepShape([(2048, 0, True)])
    assert rows.expert_imbalance(2048) == 1.0 and whole.expert_ranks == 2
    assert 1.01 < whole.expert_imbalance(2048) < 1.05 < whole.expert_imbalance(16) <= 2
    assert 1.005 < whole.roofline(prompt) / rows.roofline(prompt) < 1.05
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"--tensor-parallel-size 16 does not divide the "
                                         r"model's 8 routed experts \(--enable-expert-parallel"):
        build_simulator(str(tmp_path), "h100", {"tensor_parallel_size": 16,
                                                "enable_expert_parallel": True})


def test_pipeline_stages_run_in_turn_hold_their_layers_and_pay_their_hand_offs():
    """Llama-3-70B as four ranks in each of two stages: a step costs what the four ranks'
    step over every layer costs plus one hand-off of the step's hidden states and one of
    the sampled rows' final states back; each device holds half the layers, so the KV
    pool holds more blocks than four ranks of every layer can, and eight stages of one
    rank need no all-reduce at all."""
    arch = model_arch("llama-3-70b")
    slow = Hardware("h100-slow-links", 989e12, 3.35e12, 80e9, all_reduce_latency=1e-4,
                    all_reduce_bandwidth=1e9)
    decode = StepShape([(1, 100, True)] * 8)
    four, staged = (CostModel(part_arch(arch, 4), slow, tp=4, pp=pp) for pp in (1, 2))
    hand_offs = 2e-4 + 8 * arch.hidden_size * 4 / 1e9 * 2
    assert staged.shape_time(decode) - four.shape_time(decode) == pytest.approx(hand_offs)
    assert CostModel(arch, slow, pp=8).all_reduce_time(8, 8) == 0.0
    blocks = [build_simulator("llama-3-70b", "h100", {"tensor_parallel_size": 4,
                                                       "pipeline_parallel_size": pp})[3]
              .cache.num_blocks for pp in (1, 2)]
    assert blocks[1] > 2 * blocks[0]


def test_pipeline_stages_with_a_step_in_flight_each_overlap_their_steps():
    """Llama-3-70B as two stages of four ranks: with a step in flight per stage (the
    simulator's default) a step enters the first stage once the one before left it, so a
    load of long prompts ends in well under the time of stages in turn and a decode load
    no later; every request still gets all its tokens, steps end in the order they
    started and never more than two are in flight. A P/D replica holds one step."""
    import random

    from tidal.bench.dataset import BenchRequest

    rng = random.Random(0)

    def load(n: int, prompt: int, output: int) -> list[BenchRequest]:
        return [BenchRequest([rng.randrange(1000, 30000) for _ in range(prompt)], output)
                for _ in range(n)]

    def duration(work: list[BenchRequest], **knobs) -> float:
        sim = build_simulator("llama-3-70b", "h100", {"tensor_parallel_size": 4,
                                                      "pipeline_parallel_size": 2, **knobs})[0]
        (replica,) = sim.replicas
        assert replica.depth == knobs.get("batches_in_flight", 2)
        ends, start = [], replica.start

        def spy(now: float) -> float | None:
            end = start(now)
            assert len(replica.flight) <= replica.depth
            if end is not None:
                ends.append(end)
            return end
        replica.start = spy
        run = sim.run(work, [0.0] * len(work))
        assert [r.output_len for r in run.results] == [w.output_len for w in work]
        assert ends == sorted(ends) and len(ends) == run.steps
        return run.duration

    prompts, decodes = load(64, 2000, 4), load(128, 200, 200)
    assert duration(prompts) < 0.65 * duration(prompts, batches_in_flight=1)
    assert duration(decodes) < duration(decodes, batches_in_flight=1)
    sim = build_simulator("llama-3-70b", "h100", {"tensor_parallel_size": 4,
                                                  "pipeline_parallel_size": 2}, pd="1P1D")[0]
    assert [r.depth for r in sim.replicas] == [1, 1]
