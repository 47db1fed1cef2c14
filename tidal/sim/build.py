"""The simulator `tidal simulate` runs, built from a model profile, a hardware profile, engine
options, a scheduler baseline and a topology; `tidal calibrate` builds the same one to check a
fitted profile."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from tidal.cluster.launch import parse_pd
from tidal.core.step_sizing import default_step_target
from tidal.engine.config import EngineConfig
from tidal.model.config import (ModelArch, check_shardable, part_arch, stage_arch,
                                stage_layers)
from tidal.sim.cost_model import CostModel
from tidal.sim.profiles import Hardware, hardware, kv_blocks_for, model_arch
from tidal.sim.simulator import ClusterSpec, Simulator

# Scheduler presets: tidal's defaults, and two baselines run by the same Scheduler class.
BASELINES = {
    "tidal": {},
    # vLLM v1's scheduler as far as these knobs express it: FCFS, decodes and prefill chunks
    # in one batch under one token budget, no decode reservation, newest-first recompute
    # preemption. (vLLM may chunk several prompts in a step; tidal chunks one at a time.)
    "vllm": dict(policy="fcfs", batch_mode="mixed", init_new_token_ratio=0.0,
                 preemption_order="newest", chunked_prefill_size=8192,
                 max_input_tokens_per_step=8192),
    # No chunking: whole prompts in prefill-only steps (vLLM v0's default); the step budget
    # is set to max_model_len so any prompt fits.
    "nochunk": dict(batch_mode="separate", chunked_prefill_size=None,
                    max_input_tokens_per_step=None),
}



def build_simulator(model_config: str = "llama-3-8b", hw: str | Hardware = "h100",
                    options: dict[str, Any] | None = None, *, baseline: str = "tidal",
                    pd: str | None = None, routing: str = "round_robin",
                    link_bandwidth: float = 50.0, prefill_path: str = "prefill-only",
                    spec_acceptance: float = 0.0,
                    ) -> tuple[Simulator, ModelArch, Hardware, EngineConfig]:
    """The simulator of `tidal simulate`: `model_config` (a built-in profile, a config.json
    or a model folder) on `hw` (a profile name, a calibrated JSON file, or a Hardware),
    with the engine `options` (any `EngineConfig.from_kwargs` keyword; the scheduler
    `baseline`'s presets under them), `pd` ("xPyD") or data-parallel replicas, `routing`
    and a KV link of `link_bandwidth` GB/s. `spec_acceptance` > 0 models speculative
    decoding: a proposer that always offers num_speculative_tokens guesses (4 unless given),
    each accepted with that chance after the ones before it. Returns the simulator, the model, the hardware
    and the engine config it runs (whose max_model_len is the context workloads are
    clipped to; its cache's num_blocks is each replica's pool)."""
    arch = model_arch(model_config)
    hw = hardware(hw) if isinstance(hw, str) else hw
    options = dict(options or {})
    # The context: max_model_len if given, else the model's.
    context = min(options.get("max_model_len", arch.context_length), arch.context_length)
    knobs = {k: context if v is None else v  # None: "as long as the context"
             for k, v in BASELINES[baseline].items()}
    knobs.update(options)
    knobs["max_model_len"] = context
    if not 0 <= spec_acceptance < 1:
        raise ValueError(f"spec_acceptance must be in [0, 1); got {spec_acceptance}")
    if spec_acceptance:  # the method stands for the modelled proposer; none runs here
        knobs.setdefault("speculative_method", "ngram")
    elif knobs.get("num_speculative_tokens"):
        raise ValueError("num_speculative_tokens in a simulation needs spec_acceptance "
                         "(--spec-acceptance): the chance each guess is accepted")
    # a step in flight per stage: each stage on devices of its own (1: stages in turn)
    knobs.setdefault("batches_in_flight", knobs.get("pipeline_parallel_size", 1))
    config = EngineConfig.from_kwargs(**knobs)  # routes each knob to the config owning it
    tp, pp = config.parallel.tensor_parallel_size, config.parallel.pipeline_parallel_size
    experts = config.parallel.enable_expert_parallel
    check_shardable(arch, tp, experts)
    rank = part_arch(arch, tp, experts)  # what each device of a replica holds and computes
    if config.model.num_kv_blocks is None:  # what fits beside the weights (the first stage
        # holds the most layers)
        stage = stage_arch(rank, stage_layers(arch.num_layers, pp, 0))
        blocks = kv_blocks_for(stage, hw, config.cache.block_size, config.model.kv_cache_dtype)
        config = replace(config, model=replace(config.model, num_kv_blocks=blocks),
                         cache=replace(config.cache, num_blocks=blocks))
    cost = CostModel(rank, hw, tp, pp, config.model.kv_cache_dtype)
    if config.scheduler.max_step_ms is None:  # as the engine derives it on that hardware
        target = (hw.max_step_ms if hw.max_step_ms is not None
                  else default_step_target(not hw.on_cpu, cost))
        config = replace(config, scheduler=replace(config.scheduler, max_step_ms=target))
    num_prefill = num_decode = 0
    if pd:
        num_prefill, num_decode = parse_pd(pd)
    spec = ClusterSpec(data_parallel_size=config.parallel.data_parallel_size,
                       num_prefill=num_prefill, num_decode=num_decode, routing=routing,
                       link_bandwidth=link_bandwidth * 1e9, prefill_path=prefill_path,
                       spec_acceptance=spec_acceptance)
    sim = Simulator(spec, config.scheduler, config.cache, cost)
    return sim, arch, hw, config
