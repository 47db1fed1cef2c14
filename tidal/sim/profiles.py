"""What the simulator simulates: a model (its shapes, from a config.json or a built-in name)
on a piece of hardware (peak compute and bandwidth, with efficiency factors and CPU
overheads that `tidal calibrate` fits from the real model runner)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from tidal.model.config import KV_SCALE_BYTES, ModelArch

# config.json fields of the built-in model profiles (the models' published configs).
MODEL_CONFIGS: dict[str, dict] = {
    "llama-3-8b": dict(model_type="llama", hidden_size=4096, intermediate_size=14336,
                       num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                       vocab_size=128256, rms_norm_eps=1e-5, rope_theta=500000.0,
                       max_position_embeddings=8192, tie_word_embeddings=False,
                       bos_token_id=128000, eos_token_id=128009),
    "llama-3-70b": dict(model_type="llama", hidden_size=8192, intermediate_size=28672,
                        num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
                        vocab_size=128256, rms_norm_eps=1e-5, rope_theta=500000.0,
                        max_position_embeddings=8192, tie_word_embeddings=False,
                        bos_token_id=128000, eos_token_id=128009),
    "smollm2-135m": dict(model_type="llama", hidden_size=576, intermediate_size=1536,
                         num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                         vocab_size=49152, rms_norm_eps=1e-5, rope_theta=100000.0,
                         max_position_embeddings=8192, tie_word_embeddings=True,
                         bos_token_id=1, eos_token_id=2),
}


def model_config(name: str) -> dict:
    """config.json of a built-in profile, a config.json path, or a model folder."""
    if name in MODEL_CONFIGS:
        return dict(MODEL_CONFIGS[name])
    path = Path(name)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"--model-config {name!r} is neither a built-in profile "
                                f"({', '.join(MODEL_CONFIGS)}) nor a config.json")
    return json.loads(path.read_text())


def model_arch(name: str) -> ModelArch:
    return ModelArch.from_dict(model_config(name))


@dataclass
class Hardware:
    """One accelerator (or CPU) and the factors that turn its datasheet into step times."""

    name: str
    peak_flops: float  # dense bf16 FLOP/s
    mem_bandwidth: float  # bytes/s
    memory_bytes: float  # for the weights and the KV cache
    compute_efficiency: float = 0.6  # share of peak the linear layers reach
    attention_efficiency: float = 0.4  # share of peak attention reaches
    bandwidth_efficiency: float = 0.8  # share of peak bandwidth weight/KV reads reach
    step_overhead: float = 0.0  # seconds per step (scheduling, launches, sampling)
    seq_overhead: float = 0.0  # seconds per scheduled sequence (input building, sampling)
    token_overhead: float = 0.0  # seconds per scheduled token
    context_overhead: float = 0.0  # seconds per cached token a step gathers to attend
    # A tensor-parallel group's all-reduce (two a layer): seconds a call, and bytes of the
    # summed tensor a second (0: its size costs nothing more).
    all_reduce_latency: float = 0.0
    all_reduce_bandwidth: float = 0.0
    # What serving adds before the runner (`tidal calibrate --serving-url`; that calibration
    # also folds the server's measured step times into the factors and step_overhead).
    request_latency: float = 0.0  # seconds from a request's send to its scheduler
    memory_utilization: float = 0.9  # share of memory the engine may use
    dtype_bytes: int = 2  # bytes per weight and KV element (calibrate: the runner's dtype)
    # Bytes per weight where they are not dtype_bytes (calibrate: what a runner of quantized
    # weights holds, e.g. ~0.6 for a Q4_K_M GGUF served in its own formats); 0: dtype_bytes.
    weight_bytes: float = 0.0
    calibrated_on: str = ""  # what `tidal calibrate` measured, if it made this profile
    # The engine's step target (max_step_ms) on this hardware, as a server calibrated
    # against reported it; None: derived from this profile as the engine derives it.
    max_step_ms: float | None = None
    # A tidal server's learned step-time model on this hardware: seconds per unit of each
    # of tidal.core.STEP_TIME_TERMS (`tidal calibrate --learned-from`). When set, steps take
    # what it predicts (plus step_overhead), not the roofline.
    step_time: list[float] | None = None
    # How that server's steps scattered around the model's predictions: measured /
    # predicted seconds at each of tidal.core.ERROR_QUANTILES. When set, each simulated
    # step's predicted seconds are scaled by a draw from that distribution (the scheduler
    # still plans with the prediction, as the server's does).
    step_scatter: list[float] | None = None

    @property
    def on_cpu(self) -> bool:
        """A CPU's profile (`cpu`, and what `tidal calibrate --hardware cpu` writes)."""
        return self.name == "cpu" or self.name.startswith("cpu-")

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)


HARDWARE: dict[str, Hardware] = {
    # H100 SXM datasheet: 989 TFLOP/s dense bf16, 3.35 TB/s HBM3, 80 GB. The factors are
    # typical of a CUDA-graph engine (vLLM reaches ~80% of HBM bandwidth in decode).
    # All-reduce over NVLink: ~10 us a call, ~300 GB/s of the summed tensor (NCCL's
    # algorithm bandwidth for 2-8 GPUs, roughly).
    "h100": Hardware("h100", 989e12, 3.35e12, 80e9, step_overhead=1.5e-3,
                     seq_overhead=5e-6, all_reduce_latency=10e-6, all_reduce_bandwidth=300e9),
    # A 2-core VM's rough roofline (~350 GFLOP/s matmul, ~43 GB/s copy), a starting point
    # only: `tidal calibrate` fits a machine's own profile (the shipped cpu-smollm2-135m.json
    # was fitted on a 2-core AVX2 AMD EPYC, float32: docs/simulator.md).
    # Its all-reduce: tidal's shared-memory sum between two ranks, measured on a 2-core
    # AMD EPYC: 6 us a call, ~0.9 GB/s of a 2 MB tensor.
    "cpu": Hardware("cpu", 350e9, 43e9, 24e9, all_reduce_latency=6e-6,
                    all_reduce_bandwidth=0.9e9),
    # H200: the same compute with 4.8 TB/s and 141 GB.
    "h200": Hardware("h200", 989e12, 4.8e12, 141e9, step_overhead=1.5e-3, seq_overhead=5e-6,
                     all_reduce_latency=10e-6, all_reduce_bandwidth=300e9),
}

CALIBRATED_DIR = Path(__file__).resolve().parent / "calibrated"


def hardware(name: str) -> Hardware:
    """A built-in profile, a calibrated one shipped in tidal/sim/calibrated, or a JSON file
    written by `tidal calibrate`."""
    if name in HARDWARE:
        return Hardware(**asdict(HARDWARE[name]))
    path = Path(name)
    if not path.is_file():
        path = CALIBRATED_DIR / f"{name}.json"
    if not path.is_file():
        known = list(HARDWARE) + sorted(p.stem for p in CALIBRATED_DIR.glob("*.json"))
        raise FileNotFoundError(f"--hardware {name!r}: not a profile ({', '.join(known)}) "
                                f"nor a JSON file from `tidal calibrate`")
    data = json.loads(path.read_text())
    names = {f.name for f in fields(Hardware)}
    return Hardware(**{k: v for k, v in data.items() if k in names})


def kv_token_bytes(arch: ModelArch, hw: Hardware, kv_cache_dtype: str = "auto") -> int:
    """A token's KV bytes on `hw`: its dtype's, bf16's, float32's, or one byte a value and a
    2-byte scale a row with a quantized --kv-cache-dtype (tidal.model.kv_quant)."""
    if kv_cache_dtype == "auto":
        return arch.kv_bytes_per_token(hw.dtype_bytes)
    floats = {"bfloat16": 2, "float32": 4}
    if kv_cache_dtype in floats:
        return arch.kv_bytes_per_token(floats[kv_cache_dtype])
    return arch.kv_bytes_per_token(1, KV_SCALE_BYTES)


def kv_blocks_for(arch: ModelArch, hw: Hardware, block_size: int,
                  kv_cache_dtype: str = "auto") -> int:
    """KV blocks that fit beside the weights in the usable memory, as the runner sizes it
    (`arch`: what one device holds, a tensor-parallel rank's shapes)."""
    weights = weight_params(arch) * (hw.weight_bytes or hw.dtype_bytes)
    free = hw.memory_bytes * hw.memory_utilization - weights
    blocks = int(free // (kv_token_bytes(arch, hw, kv_cache_dtype) * block_size))
    if blocks < 1:
        raise ValueError(f"{hw.name}: the {weights / 1e9:.1f} GB of weights a device holds "
                         f"leave no room for a KV cache")
    return blocks


def linear_params(arch: ModelArch) -> int:
    """Parameters of the projections one token goes through in every layer (q, k, v, o and
    gate, up, down: the dense MLP's, or its top-k experts', shared expert and router's; of
    experts split whole across ranks, the share of the top k a rank holds on average)."""
    q, kv = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    attention = arch.hidden_size * (q + 2 * kv) + q * arch.hidden_size
    dense = 3 * arch.hidden_size * arch.intermediate_size
    moe, total = arch.moe, 0
    for layer in range(arch.num_layers):
        if moe and moe.layers[layer]:
            mlp = arch.hidden_size * (3 * _picked(moe) * moe.intermediate_size
                                      + moe.num_experts + 3 * moe.shared_intermediate_size)
        else:
            mlp = dense
        total += attention + mlp
    return int(total)


def _picked(moe) -> float:
    """The experts of a token's top k that the model (or rank) holds, on average."""
    return moe.top_k * moe.held / moe.num_experts


def picked_expert_params(arch: ModelArch) -> float:
    """Parameters of the routed experts one token goes through on this rank, on average,
    over every layer (0 for a dense model)."""
    moe = arch.moe
    if moe is None:
        return 0.0
    return sum(moe.layers) * _picked(moe) * 3 * arch.hidden_size * moe.intermediate_size


def expert_params(arch: ModelArch) -> int:
    """Parameters of every routed expert held, of every layer (0 for a dense model)."""
    moe = arch.moe
    if moe is None:
        return 0
    return sum(moe.layers) * moe.held * 3 * arch.hidden_size * moe.intermediate_size


def weight_params(arch: ModelArch) -> int:
    embed = arch.vocab_size * arch.hidden_size
    routed = expert_params(arch)
    if routed:  # all experts are stored; linear_params counted the top k of them
        routed -= picked_expert_params(arch)
    return int(linear_params(arch) + routed) + embed * (1 if arch.tie_word_embeddings else 2)
