"""The simulator: the cost model's arithmetic, the event loop's timings on hand-computed
cases, data-parallel routing, xPyD with KV transfers, calibration, and `tidal simulate`."""

from __future__ import annotations

import json
import os

import pytest

from tidal.bench.dataset import DATA_DIR, BenchRequest, DatasetSpec, load_dataset
from tidal.cluster.routing import CoreLoad, Router
from tidal.core import CacheConfig, SchedulerConfig
from tidal.sim.calibrate import fit
from tidal.sim.cost_model import CostModel, StepShape
from tidal.sim.profiles import Hardware, hardware, kv_blocks_for, linear_params, model_arch
from tidal.sim.simulator import ClusterSpec, Simulator

ARCH = model_arch("llama-3-8b")


def overhead_only(step: float = 1e-3) -> Hardware:
    """Infinitely fast hardware: every step takes exactly `step` seconds."""
    return Hardware("ideal", 1e30, 1e30, 80e9, step_overhead=step)


def sim(hw: Hardware, spec: ClusterSpec | None = None, num_blocks: int = 1000,
        **sched) -> Simulator:
    return Simulator(spec or ClusterSpec(),
                     SchedulerConfig.from_kwargs(max_model_len=8192, **sched),
                     CacheConfig(num_blocks=num_blocks, block_size=16), CostModel(ARCH, hw))


def test_llama_3_8b_profile_has_its_parameter_count():
    total = linear_params(ARCH) + 2 * ARCH.vocab_size * ARCH.hidden_size
    assert total == pytest.approx(8.03e9, rel=0.01)  # Llama-3-8B: 8.03B parameters
    assert ARCH.kv_bytes_per_token(2) == 131072  # 32 layers x 8 KV heads x 128 x 2 x 2 bytes


def test_decode_is_bandwidth_bound_and_long_prefill_compute_bound():
    hw = hardware("h100")
    cost = CostModel(ARCH, hw)
    one = StepShape([(1, 100, True)])
    weights = cost.weight_bytes / (hw.mem_bandwidth * hw.bandwidth_efficiency)
    assert cost.roofline(one) == pytest.approx(weights, rel=0.01)
    prefill = StepShape([(8192, 0, True)])
    flops = 2 * linear_params(ARCH) * 8192 + 2 * ARCH.vocab_size * ARCH.hidden_size
    attention = 4 * ARCH.num_layers * ARCH.num_heads * ARCH.head_dim * (8192 * 8193 // 2)
    expected = flops / (hw.peak_flops * hw.compute_efficiency) + attention / (
        hw.peak_flops * hw.attention_efficiency)
    assert cost.roofline(prefill) == pytest.approx(expected, rel=1e-6)
    # Batching decodes is nearly free until compute catches up with the weight reads.
    assert cost.roofline(StepShape([(1, 100, True)] * 32)) < 1.2 * cost.roofline(one)


def test_a_step_shape_sums_what_the_scheduler_planned():
    """StepShape.of (with its shortcut for decode-only steps) gives the totals of the entry
    form for every step of a run that mixes prefills, chunks and decodes."""
    from tidal.core import KVCacheManager, Request, SamplingParams, Scheduler
    from tidal.core.outputs import ModelOutput

    sched = Scheduler(SchedulerConfig(max_model_len=512, chunked_prefill_size=48),
                      KVCacheManager(CacheConfig(num_blocks=64, block_size=16)))
    for i, n in enumerate((5, 100, 17, 33)):
        sched.add_request(Request(str(i), list(range(1, n + 1)), SamplingParams(max_tokens=6)))
    kinds = set()
    while sched.has_unfinished_requests():
        out = sched.schedule()
        kinds.add(out.kind)
        entries = [(s.num_new_tokens, s.num_computed_tokens, s.samples) for s in out.scheduled]
        fast, plain = StepShape.of(out), StepShape(entries)
        assert {k: getattr(fast, k) for k in StepShape.__slots__} == \
            {k: getattr(plain, k) for k in StepShape.__slots__}
        assert plain.pairs == sum(n * c + n * (n + 1) // 2 for n, c, _ in entries)
        sched.update(out, ModelOutput(sampled={s.request_id: [7] for s in out.scheduled
                                               if s.samples}))
    assert {"prefill", "mixed", "decode"} <= kinds


def test_kv_blocks_fill_what_the_weights_leave():
    hw = hardware("h100")
    blocks = kv_blocks_for(ARCH, hw, 16)
    assert blocks * 16 * 131072 == pytest.approx(80e9 * 0.9 - 16.06e9, rel=0.01)
    hw.dtype_bytes = 4  # a float32 profile (what `tidal calibrate` records of a CPU runner)
    blocks = kv_blocks_for(ARCH, hw, 16)
    assert blocks * 16 * 262144 == pytest.approx(80e9 * 0.9 - 32.12e9, rel=0.01)
    decode = StepShape([(1, 100, True)])
    assert CostModel(ARCH, hw).roofline(decode) == pytest.approx(
        2 * CostModel(ARCH, hardware("h100")).roofline(decode))


def test_a_quantized_kv_cache_holds_twice_the_tokens_and_reads_half_the_bytes():
    from tidal.sim.build import build_simulator

    hw = hardware("h100")
    bf16 = kv_blocks_for(ARCH, hw, 16)
    # 128 one-byte values and a 2-byte scale a row, against 256 bytes of bf16
    assert kv_blocks_for(ARCH, hw, 16, "int8") == pytest.approx(bf16 * 256 / 130, rel=0.01)
    long_decode = StepShape([(1, 30000, True)])
    assert CostModel(ARCH, hw, kv_cache_dtype="fp8_e4m3").roofline(long_decode) < \
        CostModel(ARCH, hw).roofline(long_decode)
    sim, *_, config = build_simulator("llama-3-8b", "h100", {"kv_cache_dtype": "int8"})
    assert config.cache.num_blocks == kv_blocks_for(ARCH, hw, 16, "int8")


def test_one_request_takes_one_step_per_token():
    """Prompt of 100 (one prefill step, which samples the first token) then 4 decode steps,
    1 ms each: TTFT 1 ms, ITL 1 ms, end to end 5 ms."""
    run = sim(overhead_only()).run([BenchRequest(list(range(1, 101)), 5)], [0.0])
    (r,) = run.results
    assert r.success and r.output_len == 5
    assert r.ttft == pytest.approx(1e-3)
    assert r.itl == pytest.approx([1e-3] * 4)
    assert r.latency == pytest.approx(5e-3)
    assert run.steps == 5 and run.busy_seconds == pytest.approx(5e-3)


def test_request_latency_delays_the_arrival_at_the_scheduler():
    """TTFT 2 ms of latency + a 1 ms step; the steps after it are not stretched."""
    hw = overhead_only()
    hw.request_latency = 2e-3
    (r,) = sim(hw).run([BenchRequest(list(range(1, 101)), 3)], [0.0]).results
    assert r.ttft == pytest.approx(3e-3)
    assert r.itl == pytest.approx([1e-3] * 2)


def test_a_concurrency_cap_holds_sends_until_a_request_finishes():
    """Three requests sent at once, at most two in flight: the third goes out when the
    first finishes (3 ms) and its TTFT counts from then, as the bench client's does; b's
    next step has already started, so c's prefill runs in the one after (TTFT 2 ms)."""
    reqs = [BenchRequest(list(range(1, 101)), 3), BenchRequest(list(range(200, 300)), 5),
            BenchRequest(list(range(400, 500)), 1)]
    a, b, c = sim(overhead_only()).run(reqs, [0.0] * 3, max_concurrency=2).results
    assert (a.start, b.start, c.start) == (0.0, 0.0, pytest.approx(3e-3))
    assert a.latency == pytest.approx(3e-3) and c.ttft == pytest.approx(2e-3)
    uncapped = sim(overhead_only()).run(reqs, [0.0] * 3).results
    assert uncapped[2].start == 0.0 and uncapped[2].ttft < c.start + c.ttft


def test_a_later_arrival_joins_the_running_batch():
    """b arrives at 2.5 ms, while a decodes: it waits for the step in flight (ends at 3 ms),
    then its prefill runs in a's decode step (mixed batch): its first token at 4 ms."""
    reqs = [BenchRequest(list(range(1, 101)), 10), BenchRequest(list(range(200, 300)), 2)]
    run = sim(overhead_only()).run(reqs, [0.0, 2.5e-3])
    a, b = run.results
    assert b.ttft == pytest.approx(1.5e-3)
    assert a.itl == pytest.approx([1e-3] * 9)  # no stall: prefill and decode share steps
    assert b.latency == pytest.approx(2.5e-3)


def test_chunked_prefill_splits_a_long_prompt_over_steps():
    run = sim(overhead_only(), chunked_prefill_size=256, max_input_tokens_per_step=256).run(
        [BenchRequest(list(range(1, 1001)), 2)], [0.0])
    assert run.results[0].ttft == pytest.approx(4e-3)  # 256 + 256 + 256 + 232


def test_every_request_finishes_and_no_block_leaks():
    reqs = load_dataset(DatasetSpec(name="azure-conv", num_prompts=300,
                                    vocab_size=ARCH.vocab_size, max_model_len=8192))
    times = [r.arrival - reqs[0].arrival for r in reqs]
    runs = []
    for async_scheduling in (False, True):
        s = sim(hardware("h100"), num_blocks=800,  # tight: forces retractions
                async_scheduling=async_scheduling)
        run = s.run(reqs, times)
        assert all(r.success for r in run.results)
        assert [r.output_len for r in run.results] == [r.output_len for r in reqs]
        sched = s.replicas[0].scheduler
        sched.check_invariants()
        assert not sched.requests and sched.kv.num_free == 800
        assert run.preemptions > 0
        runs.append(run)
    # The simulated executor acknowledges a preemption when its step ends, so waiting for
    # the acknowledgement (async scheduling) changes nothing.
    sync, ahead = runs
    assert [(r.ttft, r.itl) for r in ahead.results] == [(r.ttft, r.itl) for r in sync.results]


def test_reservation_preempts_less_than_the_vllm_style_baseline():
    reqs = load_dataset(DatasetSpec(name="azure-conv", num_prompts=300,
                                    vocab_size=ARCH.vocab_size, max_model_len=8192))
    times = [0.0] * len(reqs)
    tidal = sim(hardware("h100"), num_blocks=1500).run(reqs, times)
    vllm = sim(hardware("h100"), num_blocks=1500, init_new_token_ratio=0.0,
               preemption_order="newest").run(reqs, times)
    assert tidal.preemptions < vllm.preemptions


def test_routing_policies():
    rr = Router("round_robin", 3)
    assert [rr.choose([]) for _ in range(4)] == [0, 1, 2, 0]
    loads = [CoreLoad(50), CoreLoad(10), CoreLoad(30, prefix_hit_tokens=64)]
    assert Router("least_tokens", 3).choose(loads) == 1
    assert Router("prefix_aware", 3).choose(loads) == 2
    assert Router("prefix_aware", 3).choose(loads[:2]) == 1  # no hit anywhere: least loaded
    loads[1].available = loads[2].available = False  # gone cores are never chosen
    assert Router("least_tokens", 3).choose(loads) == Router("prefix_aware", 3).choose(loads) == 0
    assert [rr.choose(loads) for _ in range(3)] == [0, 0, 0]
    # slack: the fewest queued prompt tokens, then the least outstanding
    loads = [CoreLoad(10, prefill_tokens=900), CoreLoad(80, prefill_tokens=100),
             CoreLoad(50, prefill_tokens=100)]
    assert Router("slack", 3).choose(loads) == 2
    with pytest.raises(ValueError):
        Router("random", 2)


def test_prefix_aware_routing_keeps_groups_together():
    reqs = load_dataset(DatasetSpec(name="shared-prefix", num_prompts=64, num_groups=3,
                                    prefix_len=512, input_len=32, output_len=16,
                                    vocab_size=ARCH.vocab_size, max_model_len=8192))
    times = [i * 0.05 for i in range(len(reqs))]
    hits = {}
    for policy in ("round_robin", "prefix_aware"):
        s = sim(hardware("h100"), ClusterSpec(data_parallel_size=4, routing=policy))
        run = s.run(reqs, times)
        assert all(r.success for r in run.results)
        hits[policy] = sum(r.scheduler.prefix_hit_tokens for r in s.replicas)
    assert hits["prefix_aware"] > hits["round_robin"]


def test_disaggregated_requests_pay_for_their_kv_transfer():
    """1P1D, ideal compute, 1 ms steps: prefill step (1 ms), then the prompt's KV (1000
    tokens x 128 KiB) over 1 GB/s = 131 ms, then decode steps of 1 ms each."""
    spec = ClusterSpec(num_prefill=1, num_decode=1, link_bandwidth=1e9, link_latency=0.0)
    s = sim(overhead_only(), spec)
    run = s.run([BenchRequest(list(range(1, 1001)), 3)], [0.0])
    (r,) = run.results
    transfer = 1000 * 131072 / 1e9
    assert r.success and r.output_len == 3
    assert r.ttft == pytest.approx(1e-3 + transfer)
    assert r.itl == pytest.approx([1e-3, 1e-3])
    for replica in s.replicas:  # the prefill side freed its blocks, the decode side too
        assert not replica.scheduler.requests
        assert replica.scheduler.kv.num_free == 1000
    prefill, decode = s.replicas
    assert prefill.steps == 1 and decode.steps == 2


def test_prefill_only_path_chunks_every_prompt_under_the_full_budget():
    """Two 1000-token prompts at once, 1 ms steps, chunks of 256 under a 1024-token budget.
    The prefill role's path takes A whole and B's first 24 tokens, then B's rest (2 steps);
    the mixed scheduler as a prefill instance chunks one prompt at a time: A in 256, 256,
    256, 232, then B the same (B starts beside A's last chunk: 7 steps)."""
    transfer = 1000 * 131072 / 1e12
    for path, ttfts, steps in (("prefill-only", [1e-3, 2e-3], 2),
                               ("shared", [4e-3, 7e-3], 7)):
        spec = ClusterSpec(num_prefill=1, num_decode=1, link_bandwidth=1e12, link_latency=0.0,
                           prefill_path=path)
        s = sim(overhead_only(), spec, chunked_prefill_size=256, max_input_tokens_per_step=1024)
        run = s.run([BenchRequest(list(range(1, 1001)), 2),
                     BenchRequest(list(range(2001, 3001)), 2)], [0.0, 0.0])
        assert [r.ttft for r in run.results] == pytest.approx([t + transfer for t in ttfts])
        assert all(r.success and r.output_len == 2 for r in run.results)
        assert s.prefill[0].steps == steps
        assert [r.scheduler.kv.num_free for r in s.replicas] == [1000, 1000]


@pytest.mark.parametrize("path", ["prefill-only", "shared"])
def test_disaggregation_serves_a_trace_to_the_end(path):
    reqs = load_dataset(DatasetSpec(name="azure-conv", num_prompts=200,
                                    vocab_size=ARCH.vocab_size, max_model_len=8192))
    s = sim(hardware("h100"), ClusterSpec(num_prefill=1, num_decode=3, prefill_path=path),
            num_blocks=3000)
    run = s.run(reqs, [r.arrival - reqs[0].arrival for r in reqs])
    assert all(r.success for r in run.results)
    assert sum(r.output_len for r in run.results) == sum(r.output_len for r in reqs)
    for replica in s.replicas:
        replica.scheduler.check_invariants()
        assert replica.scheduler.kv.num_free == 3000


def test_calibration_recovers_known_factors():
    truth = Hardware("t", 100e12, 1e12, 80e9, compute_efficiency=0.5,
                     attention_efficiency=0.3, bandwidth_efficiency=0.7,
                     step_overhead=2e-3, seq_overhead=1e-5, token_overhead=0.0,
                     context_overhead=5e-9)
    cost = CostModel(ARCH, truth)
    shapes = [StepShape((n, c, True) for n, c in [(1, 64)] * b) for b in (1, 8, 64, 256)]
    shapes += [StepShape([(1, 2048, True)] * b) for b in (1, 8, 64, 256)]
    shapes += [StepShape([(n, 0, True)]) for n in (128, 1024, 4096, 8192)]
    timings = [(s, cost.shape_time(s)) for s in shapes]
    guess = Hardware("t", 100e12, 1e12, 80e9)
    profile, error = fit(CostModel(ARCH, guess), timings)
    assert error < 0.03
    # A constant weight read and a step overhead look alike, so the factors themselves are
    # not unique; what must hold is the prediction, on shapes the fit never saw too.
    fitted = CostModel(ARCH, profile)
    for shape in (StepShape([(1, 512, True)] * 32), StepShape([(2048, 0, True)]),
                  StepShape([(256, 0, True)] + [(1, 256, True)] * 16)):
        assert fitted.shape_time(shape) == pytest.approx(cost.shape_time(shape), rel=0.05)


def test_the_issues_simulate_command_runs_as_written(tmp_path, monkeypatch):
    """`--save-result out.json`: the path may follow the flag (or come from --result-file)."""
    from tidal.cli import run as main

    trace = DATA_DIR / "azure_conv_2023.csv"  # the packaged trace, named explicitly
    monkeypatch.chdir(tmp_path)
    main(["simulate", "--dataset", "azure-conv", "--dataset-path", str(trace), "--num-prompts",
          "5000", "--hardware", "h100", "--model-config", "llama-3-8b", "--save-result",
          "out.json"])
    result = json.loads((tmp_path / "out.json").read_text())
    assert result["completed"] == 5000 and result["backend"].startswith("tidal-sim")


def test_simulate_command_writes_the_bench_report(tmp_path, capsys):
    from tidal.cli import run as main

    out = tmp_path / "sim.json"
    main(["simulate", "--dataset", "azure-conv", "--num-prompts", "200", "--hardware", "h100",
          "--model-config", "llama-3-8b", "--pd", "1P3D", "--save-result", "--result-file",
          str(out), "--plot", str(tmp_path / "p"), "--goodput", "ttft:2000"])
    result = json.loads(out.read_text())
    assert result["completed"] == 200 and result["simulation"]["pd"] == "1P3D"
    assert result["request_goodput"] <= result["request_throughput"]
    assert len(result["simulation"]["timeline"]["kv_usage"]) > 10
    assert (tmp_path / "p" / "sim_timeline.png").is_file()
    assert "Simulated Serving Result" in capsys.readouterr().out


@pytest.mark.parametrize("flags, message", [
    (["--routing", "least_loaded"], "routing policy must be one of"),
    (["--block-size", "0"], "block_size must be at least 1"),
    (["--pd", "0P2D"], "pd expects xPyD with x, y >= 1"),
    (["--pd", "1P"], "pd expects xPyD with x, y >= 1"),
    (["--dataset-path", "/no/such/trace.csv"], "no trace at /no/such/trace.csv"),
    (["--goodput", "ttft:soon"], "'soon' is not a number"),
])
def test_simulate_refuses_bad_flags_with_a_message(flags, message):
    from tidal.cli import run as main

    with pytest.raises(SystemExit) as exit_:
        main(["simulate", "--dataset", "azure-conv", "--num-prompts", "5", *flags])
    assert str(exit_.value).startswith("tidal simulate: error: ")
    assert message in str(exit_.value)


def test_simulate_takes_the_engine_options_for_pool_and_replicas():
    """--num-kv-blocks and --data-parallel-size are the engine's options of those names;
    build_simulator is the same simulator as a Python function."""
    from tidal.cli import run as main
    from tidal.sim.build import build_simulator

    result = main(["simulate", "--dataset", "random", "--num-prompts", "20",
                   "--random-input-len", "64", "--random-output-len", "8",
                   "--num-kv-blocks", "700", "--data-parallel-size", "2"])
    assert result["completed"] == 20
    assert result["simulation"]["num_kv_blocks"] == 700
    assert result["simulation"]["data_parallel_size"] == 2
    sim, arch, hw, config = build_simulator("llama-3-8b", "h100", {
        "num_kv_blocks": 500, "data_parallel_size": 2, "max_model_len": 4096})
    assert [r.scheduler.kv.num_blocks for r in sim.replicas] == [500, 500]
    assert config.scheduler.max_model_len == 4096
    sim, arch, hw, config = build_simulator("llama-3-8b", "h100", baseline="nochunk")
    assert config.cache.num_blocks == kv_blocks_for(arch, hw, 16)  # what fits
    assert config.scheduler.chunked_prefill_size == config.scheduler.max_model_len == 8192


def test_calibration_runs_the_simulate_and_bench_workloads_as_functions(tmp_path):
    """What `tidal calibrate --serving-url` simulates and sends, through Python functions,
    is what the `tidal simulate` and `tidal bench serve` commands of its workload did."""
    import argparse

    from tidal.bench.flags import load_workload
    from tidal.bench.serve import add_bench_serve_parser
    from tidal.cli import run as main
    from tidal.sim.calibrate import _simulate, serving_workload

    workload = ["--dataset", "random", "--random-input-len", "128", "--random-output-len",
                "24", "--num-prompts", "12", "--seed", "14", "--max-concurrency", "4"]
    profile = hardware("cpu")
    (tmp_path / "cpu.json").write_text(profile.to_json())
    command = main(["simulate", "--model-config", "smollm2-135m", "--hardware",
                    str(tmp_path / "cpu.json"), *workload])
    busy, ttft = _simulate(profile, "smollm2-135m", 14, 4)
    assert (busy, ttft) == (command["simulation"]["busy_seconds"], command["median_ttft_ms"])
    assert profile == hardware("cpu")  # simulated on a copy
    parser = argparse.ArgumentParser()
    add_bench_serve_parser(parser.add_subparsers())
    sent = load_workload(parser.parse_args(["serve", *workload]), 49152)[:2]
    assert serving_workload(14, 49152, 2048) == sent


@pytest.mark.skipif(os.environ.get("CI") == "true",
                    reason="a wall-clock comparison with a live server: on a shared 2-core "
                           "VM the server's TPOT swings past the 15% bar either way; "
                           "benchmarks/sim_accuracy.sh measures it")
def test_simulation_of_a_calibrated_cpu_matches_a_real_server(tmp_path):
    """The issue's accuracy bar on this machine: calibrate the real runner (as the server
    runs it: one thread) and what serving adds (the server's own step times and latency,
    one and four requests at a time),
    serve another workload for real (overlapping requests, other lengths), simulate it with
    the fitted profile; TTFT, TPOT and throughput agree within 15%."""
    from server_fixtures import Server

    from tidal.cli import run as main
    from tidal.sim.calibrate import calibrate, calibrate_serving, default_grid

    workload = ["--dataset", "random", "--random-input-len", "64", "--random-output-len",
                "16", "--num-prompts", "16", "--request-rate", "2", "--seed", "3"]
    server = Server()
    try:
        profile, fit_error, _ = calibrate("smollm2-135m", hardware("cpu"),
                                          {"num_threads": 1, "num_kv_blocks": 512}, repeats=5,
                                          grid=default_grid(max_batch=8, max_prefill=256))
        assert fit_error < 0.15
        calibrate_serving(profile, "smollm2-135m", server.url)
        print(profile.calibrated_on)
        (tmp_path / "cpu.json").write_text(profile.to_json())
        real = main(["bench", "serve", "--base-url", server.url, "--ignore-eos",
                     "--disable-tqdm", "--save-result", "--result-file",
                     str(tmp_path / "real.json"), *workload])
    finally:
        server.stop()
    simulated = main(["simulate", "--model-config", "smollm2-135m", "--hardware",
                      str(tmp_path / "cpu.json"), "--num-kv-blocks", "256", "--compare",
                      str(tmp_path / "real.json"), *workload])
    assert real["completed"] == simulated["completed"] == 16
    errors = {k: c["error"] for k, c in simulated["comparison"].items()}
    assert all(abs(errors[k]) <= 0.15 for k in ("mean_ttft_ms", "mean_tpot_ms",
                                                 "output_throughput")), errors


def _on_time(run, ttft: float = 1.0, tpot: float = 0.05) -> int:
    return sum(1 for r in run.results if r.success and r.ttft <= ttft
               and (r.output_len < 2 or (r.latency - r.ttft) / (r.output_len - 1) <= tpot))


def test_the_slo_policy_keeps_more_requests_on_time_past_the_knee():
    """The Azure conversation trace at 4x its rate on one H100: FCFS queues everyone past
    the TTFT target; `slo` serves the requests that can still make it first (defer) or
    refuses the rest at once (reject). Deferred requests all finish; rejected ones say so."""
    reqs = load_dataset(DatasetSpec(name="azure-conv", num_prompts=600,
                                    vocab_size=ARCH.vocab_size, max_model_len=8192))
    times = [(r.arrival - reqs[0].arrival) / 4 for r in reqs]
    slo = dict(policy="slo", ttft_slo_ms=1000, tpot_slo_ms=50)
    fcfs = sim(hardware("h100"), num_blocks=4000).run(reqs, times)
    defer = sim(hardware("h100"), num_blocks=4000, **slo).run(reqs, times)
    reject = sim(hardware("h100"), num_blocks=4000, slo_overload="reject", **slo).run(reqs,
                                                                                      times)
    assert _on_time(defer) >= 1.5 * _on_time(fcfs)
    assert _on_time(reject) >= 1.5 * _on_time(fcfs)
    assert all(r.success for r in defer.results)
    refused = [r for r in reject.results if not r.success]
    assert refused and all(r.error == "rejected" and r.output_len == 0 for r in refused)
    print(f"on time: fcfs {_on_time(fcfs)}, slo defer {_on_time(defer)}, "
          f"slo reject {_on_time(reject)} of {len(reqs)}")


def test_below_the_knee_the_slo_policy_loses_nothing():
    reqs = load_dataset(DatasetSpec(name="azure-conv", num_prompts=600,
                                    vocab_size=ARCH.vocab_size, max_model_len=8192))
    times = [r.arrival - reqs[0].arrival for r in reqs]
    fcfs = sim(hardware("h100"), num_blocks=4000).run(reqs, times)
    slo = sim(hardware("h100"), num_blocks=4000, policy="slo", ttft_slo_ms=1000,
              tpot_slo_ms=50).run(reqs, times)
    assert _on_time(slo) >= _on_time(fcfs) * 0.98


def test_modelled_speculation_cuts_steps_at_low_load_and_turns_off_at_high_load():
    """On a fixed step time every accepted guess is a step saved; on hardware whose step
    grows with its rows, the adaptive rule stops guessing once a batch is compute-bound."""
    one = [BenchRequest(list(range(1, 101)), 64)]
    plain = sim(overhead_only()).run(one, [0.0])
    spec = sim(overhead_only(), ClusterSpec(spec_acceptance=0.8), num_speculative_tokens=4,
               speculative_adaptive=False).run(one, [0.0])
    assert spec.results[0].output_len == plain.results[0].output_len == 64
    assert spec.steps < 0.5 * plain.steps
    # compute-bound: 1 ms a step plus 1 ms a row, so a guess costs as much as a decode
    hw = Hardware("slow", 1e30, 1e30, 80e9, step_overhead=1e-3)
    cost = CostModel(ARCH, hw)
    many = [BenchRequest(list(range(1, 33)), 16) for _ in range(64)]
    runs = {}
    for adaptive in (False, True):
        s = Simulator(ClusterSpec(spec_acceptance=0.3),
                      SchedulerConfig.from_kwargs(max_model_len=8192, num_speculative_tokens=4,
                                                  speculative_adaptive=adaptive),
                      CacheConfig(num_blocks=1000, block_size=16), cost)
        s.replicas[0].scheduler.step_time = s.replicas[0].scheduler.spec.planner.step_time = \
            type("Rows", (), {"shape_time": staticmethod(
                lambda shape: 1e-3 + 1e-3 * shape.tokens if shape.seqs else 0.0)})()
        runs[adaptive] = (s.run(many, [0.0] * 64), s.replicas[0].scheduler)
    assert runs[True][1].spec.drafted_tokens < 0.2 * runs[False][1].spec.drafted_tokens
    assert all(r.success and r.output_len == 16 for r in runs[True][0].results)


def test_one_adapter_slot_serves_adapters_by_turns_and_the_base_model_alongside():
    """Requests of adapters a, b, a and of the base model, all at once, one slot: the first
    arrival starts a step alone; then the second a and the base request join it and b
    waits until a's requests have drained. With two slots b joins at once."""
    reqs = [BenchRequest(list(range(100 * i + 1, 100 * i + 101)), 4, model=m)
            for i, m in enumerate(["a", "b", "a", None])]
    a1, b, a2, base = sim(overhead_only(), max_loras=1).run(reqs, [0.0] * 4).results
    assert all(r.success for r in (a1, b, a2, base))
    assert a1.ttft == pytest.approx(1e-3)
    assert a2.ttft == base.ttft == pytest.approx(2e-3)
    assert b.ttft == pytest.approx(a2.latency + 1e-3)  # admitted once a's requests finished
    both = sim(overhead_only(), max_loras=2).run(reqs, [0.0] * 4).results
    assert both[1].ttft == pytest.approx(2e-3)
