"""`tidal simulate` (a workload through the real scheduler on a virtual clock) and `tidal
calibrate` (fit a hardware profile to the real model runner)."""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict

from tidal.bench.flags import (add_workload_flags, load_workload, report_options,
                               result_header, save_result)
from tidal.bench.metrics import format_report, parse_goodput, summarize
from tidal.engine.flags import add_engine_flags, engine_kwargs, flag_errors
from tidal.sim.build import BASELINES, build_simulator
from tidal.sim.dashboard import DashboardRecorder


def add_simulate_parser(sub) -> None:
    p = sub.add_parser("simulate", help="replay a workload through the real scheduler "
                                        "against a cost model")
    p.add_argument("--model-config", default="llama-3-8b",
                   help="built-in profile (llama-3-8b, llama-3-70b, smollm2-135m) or a "
                        "config.json / model folder")
    p.add_argument("--hardware", default="h100",
                   help="h100, h200, cpu, a calibrated profile name or a `tidal calibrate` "
                        "JSON file")
    p.add_argument("--baseline", default="tidal", choices=sorted(BASELINES),
                   help="scheduler preset applied before the engine flags below")
    p.add_argument("--pd", default=None, metavar="xPyD",
                   help="prefill/decode disaggregation, e.g. 1P3D")
    p.add_argument("--prefill-path", default="prefill-only", choices=["prefill-only", "shared"],
                   help="xPyD prefill replicas: the prefill role's path, or the mixed "
                        "scheduler with max_tokens=1")
    p.add_argument("--routing", default="round_robin",
                   help="how a request's replica is picked, among the data-parallel replicas "
                        "or the xPyD instances: round_robin, least_tokens or prefix_aware")
    p.add_argument("--link-bandwidth", type=float, default=50.0,
                   help="GB/s of a prefill-to-decode KV transfer")
    p.add_argument("--compare", default=None, metavar="RESULT_JSON",
                   help="a `tidal bench serve --save-result` file of the same workload: "
                        "print each headline metric's relative error against it")
    p.add_argument("--dashboard", default=None, metavar="HTML",
                   help="write the live dashboard's page replaying this run (self-contained "
                        "HTML); its frames also go into --save-result")
    p.add_argument("--dashboard-interval", type=float, default=1.0, metavar="SECONDS",
                   help="simulated seconds between the dashboard's frames")
    p.add_argument("--spec-acceptance", type=float, default=0.0, metavar="P",
                   help="model speculative decoding: a proposer that always offers "
                   "--num-speculative-tokens guesses (default 4), each accepted with "
                   "chance P after the ones before it (0: no speculation)")
    add_workload_flags(p, max_model_len=None)
    # The cache and scheduler options, each replica's KV pool, the data-parallel replicas and
    # the devices each spans (the hardware's memory sizes the pool when --num-kv-blocks is not
    # given).
    add_engine_flags(p, only=("cache", "scheduler"),
                     extra=("num_kv_blocks", "data_parallel_size", "tensor_parallel_size",
                            "pipeline_parallel_size", "enable_expert_parallel"))
    p.set_defaults(func=cmd_simulate)


# What `--compare` checks: the accuracy target is on TTFT, TPOT and throughput.
COMPARED = ("mean_ttft_ms", "median_ttft_ms", "mean_tpot_ms", "median_tpot_ms",
            "output_throughput", "request_throughput")


def compare(real: dict, simulated: dict) -> dict[str, dict[str, float]]:
    """Per metric: the real value, the simulated one and (sim - real) / real."""
    return {k: {"real": real[k], "sim": simulated[k],
                "error": (simulated[k] - real[k]) / real[k] if real[k] else float("inf")}
            for k in COMPARED}


def cmd_simulate(args: argparse.Namespace) -> dict:
    with flag_errors("simulate"):
        slos = parse_goodput(args.goodput)
        metrics, percentiles = report_options(args)
        sim, arch, hw, config = build_simulator(
            args.model_config, args.hardware, engine_kwargs(args), baseline=args.baseline,
            pd=args.pd, routing=args.routing, link_bandwidth=args.link_bandwidth,
            prefill_path=args.prefill_path, spec_acceptance=args.spec_acceptance)
        requests, times, spec = load_workload(args, arch.vocab_size,
                                              max_model_len=config.scheduler.max_model_len)
    recorder = None
    if args.dashboard:
        sched = config.scheduler
        ttft, tpot = sched.policy_class.latency_targets(sched.policy_options)
        recorder = DashboardRecorder(args.dashboard_interval, args.model_config,
                                     {"ttft_ms": ttft, "tpot_ms": tpot})
        sim.record_dashboard(recorder)
    t0 = time.perf_counter()
    run = sim.run(requests, times, args.max_concurrency)
    wall = time.perf_counter() - t0
    result = result_header(args, f"tidal-sim ({args.baseline})", args.model_config)
    result.update(summarize(run.results, run.duration, slos, percentiles))
    result["simulation"] = {
        "hardware": asdict(hw), "pd": args.pd, "prefill_path": args.prefill_path,
        "data_parallel_size": config.parallel.data_parallel_size,
        "tensor_parallel_size": config.parallel.tensor_parallel_size,
        "pipeline_parallel_size": config.parallel.pipeline_parallel_size,
        "enable_expert_parallel": config.parallel.enable_expert_parallel, "routing": args.routing,
        "num_kv_blocks": config.cache.num_blocks, "scheduler": config.scheduler.as_kwargs(),
        "length_scale": spec.length_scale, "steps": run.steps,
        "busy_seconds": run.busy_seconds,
        "preemptions": run.preemptions, "wall_seconds": wall,
        "simulated_requests_per_second": len(requests) / wall, "timeline": run.timeline}
    if recorder is not None:
        result["dashboard_frames"] = recorder.frames  # tidal/cli.py writes the page
    print(format_report(result, "Simulated Serving Result", metrics, percentiles))
    print(f"{'Preemptions:':<42}{run.preemptions:>18}")
    print(f"{'Steps:':<42}{run.steps:>18}")
    if args.compare:
        with open(args.compare) as f:
            result["comparison"] = compare(json.load(f), result)
        print(f"{'metric':<22}{'real':>12}{'simulated':>12}{'error':>10}")
        for k, c in result["comparison"].items():
            print(f"{k:<22}{c['real']:>12.2f}{c['sim']:>12.2f}{c['error']:>+10.1%}")
    print(f"simulated {len(requests)} requests in {wall:.2f}s of wall time "
          f"({len(requests) / wall:.0f} requests/s)")
    path = save_result(args, result, "sim")
    if path:
        print(f"result: {path}")
    if args.plot:
        from tidal.bench.plot import plot_results

        series = {k: (run.timeline["time"], v) for k, v in run.timeline.items() if k != "time"}
        for f in plot_results(run.results, args.plot, "sim", series):
            print(f"plot: {f}")
    return result


def add_calibrate_parser(sub) -> None:
    p = sub.add_parser("calibrate", help="fit a hardware profile to the real model runner")
    p.add_argument("--hardware", default="cpu", help="the profile whose factors are fitted")
    p.add_argument("--repeats", type=int, default=5, help="timed runs per step shape")
    p.add_argument("--output", default=None, help="JSON file to write (default: print)")
    p.add_argument("--max-batch", type=int, default=64, help="largest decode batch timed")
    p.add_argument("--max-prefill", type=int, default=1024, help="longest prefill timed")
    source = p.add_mutually_exclusive_group()
    source.add_argument("--learned-from", default=None, metavar="URL",
                        help="a tidal server that has served a workload: write a profile "
                             "that times steps by its own learned step-time model (no "
                             "runner timed)")
    source.add_argument("--serving-url", default=None, metavar="URL",
                        help="a tidal server of the same model and flags: also measure what "
                             "serving adds (its steps' times by its own counters, request "
                             "latency)")
    add_engine_flags(p)
    p.set_defaults(func=cmd_calibrate)


def cmd_calibrate(args: argparse.Namespace) -> None:
    from tidal.sim.calibrate import (calibrate, calibrate_serving, default_grid, format_rows,
                                     learned_profile)
    from tidal.sim.profiles import hardware

    kwargs = engine_kwargs(args)
    model = kwargs.pop("model", "smollm2-135m")
    if args.learned_from:
        profile = learned_profile(hardware(args.hardware), args.learned_from)
        print(profile.calibrated_on)
    else:
        profile, error, rows = calibrate(model, hardware(args.hardware), kwargs, args.repeats,
                                         default_grid(args.max_batch, args.max_prefill))
        print(format_rows(rows))
        print(f"mean absolute error {error:.1%}")
    if args.serving_url:
        calibrate_serving(profile, model, args.serving_url)
        print("serving:", profile.calibrated_on.rpartition("serving at ")[2])
    text = profile.to_json()
    if args.output:
        with open(args.output, "w") as f:
            f.write(text + "\n")
        print(f"profile: {args.output}")
    else:
        print(text)
