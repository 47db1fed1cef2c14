"""The engine's config tree: what model runs where, its KV memory, and the core's configs.

Every field is a documented dataclass field; `LLM(model, **kwargs)` and the CLI set any of
them by name, and every scheduling policy's options too (the scheduler's part holds the chosen
policy's). The configs are frozen: code that needs another value derives a new config
with `dataclasses.replace`.
"""

from __future__ import annotations

import json
import os
import typing
from dataclasses import dataclass, field, fields, replace
from typing import Any

from tidal.core import LOGPROBS_MODES
from tidal.core.config import CacheConfig, SchedulerConfig, knob
from tidal.core.knobs import check_choice
from tidal.core.policies import POLICIES, option_fields
from tidal.engine.parallel_config import ParallelConfig
from tidal.model.generation_config import parse_overrides
from tidal.spec import METHODS

LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
KV_CACHE_DTYPES = ("auto", "bfloat16", "float32", "int8", "fp8_e4m3")  # kv_quant's formats
QUANTIZATIONS = ("auto", "gguf", "gptq", "awq", "none", "int8", "int4")
STAGE_SPIN_COUNT = 10000  # omp_spin_count of pipeline stages that take turns


@dataclass(frozen=True)
class ModelConfig:
    """Which model runs, in what precision, where, and how much memory its KV cache gets."""

    model: str = knob("smollm2-135m", "An embedded model name, a Hugging Face folder "
                      "(config.json + safetensors) or a GGUF file.")
    tokenizer: str | None = knob(None, "A folder whose tokenizer (tokenizer.json; its "
                                 "tokenizer_config.json's chat template and special tokens) "
                                 "serves instead of the model's (vLLM's): e.g. a GGUF's "
                                 "original model. Unset: the model's own.")
    dtype: str = knob("auto", "'auto': float32 for weights in their own formats on CPU "
                      "(gguf, gptq, awq: their integer kernels round activations to int8, "
                      "a prompt's twice (prompt_rounding), and the rest of the model "
                      "computes in float32 as llama.cpp's does); else bfloat16 on GPU, on a "
                      "CPU with avx512_bf16 or amx, or with int8/int4; else float32. "
                      "'bfloat16', 'float16' or 'float32'.")
    device: str = knob("auto", "'auto' (cuda when available), 'cpu', 'cuda' or 'cuda:N'. "
                       "Data-parallel cores on a machine with several GPUs run on GPU "
                       "i modulo their number (auto or cuda).")
    quantization: str = knob("auto", "'auto': a GGUF file on CPU runs 'gguf' unless dtype "
                             "is float32 or float16 (a run that asks for a float copy); a "
                             "GPTQ or AWQ checkpoint runs 'gptq' / 'awq'; else 'none'. 'gguf': "
                             "the file's weights in their own formats (Q4_0, Q4_1, Q5_0, Q5_1, "
                             "Q8_0, Q4_K, Q5_K, Q6_K; float types as dense layers), "
                             "memory-mapped, no float copy. 'gptq', 'awq': 4-bit checkpoints "
                             "(groups of 32, 64 or 128) repacked into the GGUF kernels' Q4_0 / "
                             "Q5_0 blocks (exactly their values). These three run on CPU. "
                             "'none': dense weights in dtype (a GGUF's converted once into the "
                             "cache). 'int8': weight-only int8 "
                             "projections (per-channel absmax); 'int4': weight-only int4 in "
                             "groups of 32 for steps of a few tokens, dense for larger ones; "
                             "both of dense checkpoints, CPU only.")
    prompt_rounding: str = knob("twice", "How gguf/gptq/awq kernels round a prompt token's "
                                "inputs: 'twice' (int8, then what that left to int8: ~15 bits; "
                                "up to ~1.5x a short prefill on AVX2-only CPUs) or 'once' (int8 "
                                "per 32, as ggml). Generated tokens: once either way.")
    load_format: str = knob("auto", "'auto' reads the weights; 'dummy' makes small random "
                            "ones (only config.json is needed): for timing, as `tidal "
                            "calibrate` does for models whose weights are not here.")
    seed: int = knob(0, "Seed of the shared generator for requests without their own seed.")
    logprobs_mode: str = knob("adjusted_logprobs", "What a token's logprobs report "
                              "(vLLM's modes and tidal's default): adjusted_logprobs, after "
                              "penalties, logit_bias, bans and logits processors, before "
                              "temperature; raw_logprobs, the model's own; processed_logprobs, "
                              "after temperature and top-k/top-p/min-p too (a greedy "
                              "request's: the adjusted ones); *_logits for the logits. A "
                              "request's prompt_logprobs stay raw log-probabilities.")
    logits_processors: tuple[str, ...] = knob((), "Custom logits processors, each "
                                              "'package.module:Class', importable by every "
                                              "engine core; requests reach them through "
                                              "extra_args (vllm_xargs). See docs/serving.md.")
    num_kv_blocks: int | None = knob(None, "KV blocks in each engine core's pool. Unset: as "
                                     "many as fit in the memory the KV cache gets "
                                     "(kv_cache_memory or kv_cache_fraction; in `tidal "
                                     "simulate`, what the weights leave of the hardware's "
                                     "memory). Set it for a fixed, reproducible pool.")
    kv_cache_memory: int | None = knob(None, "Bytes for the KV cache (overrides the fraction).")
    kv_cache_fraction: float = knob(0.10, "On CPU: the share of free RAM the KV cache "
                                    "takes when no size is given.")
    kv_cache_dir: str | None = knob(None, "A folder for the disk tier of the prefix cache: "
                                    "every cached KV block is written there too, and a "
                                    "prefix found there is loaded instead of computed, "
                                    "after evictions and restarts (docs/design/kv-tiers.md). "
                                    "Unset: no disk tier.")
    kv_disk_size: float = knob(16.0, "GiB the disk tier's folder may hold (least recently "
                               "written blocks go first).")
    kv_host_memory: float = knob(0.0, "GiB of host memory for a tier of the prefix cache "
                                 "below the pool (pinned when the pool is on a GPU): "
                                 "cached blocks are kept there too, least recently used "
                                 "first out, and a prefix found there is loaded instead "
                                 "of computed. Above the disk tier when --kv-cache-dir "
                                 "is set too (docs/design/kv-tiers.md). 0: none.")
    score_tokens: str | None = knob(None, "An LLM reranker's answer tokens, false then true "
                                    "(e.g. 'no,yes', Qwen3-Reranker's): /v1/score and "
                                    "/v1/rerank score a pair by their logits (config.json's "
                                    "classifier_from_token does the same). Unset: a "
                                    "*ForSequenceClassification checkpoint's head, if any.")
    kv_cache_dtype: str = knob("auto", "The KV cache's elements: 'auto' the model's dtype, "
                               "but bfloat16 for weights in their own formats (float32 "
                               "activations) on a CPU with AMX or AVX512-BF16, where reading "
                               "K and V is a third of a many-row decode step and prompt "
                               "attention over bf16 rows runs in bf16; 'float32' a float32 "
                               "model's own (its 'auto' elsewhere); "
                               "'bfloat16' half of float32's bytes under a float32 model "
                               "(values rounded to nearest even); "
                               "'int8' or 'fp8_e4m3' one byte a value with a float16 scale "
                               "per token and KV head (about half the bytes of bf16, a "
                               "quarter of float32: that many more tokens in the same "
                               "memory; docs/design/kv-quantization.md).")
    gpu_memory_utilization: float = knob(0.9, "On GPU: the share of the device's memory "
                                         "tidal may use; the KV cache takes what the weights, "
                                         "the largest step's activations (measured by a "
                                         "forward pass at start-up) and other processes "
                                         "leave of it, when no size is given.")
    enforce_eager: bool = knob(False, "On GPU: run every step eagerly, without the CUDA "
                               "graphs captured at start-up for decode-only steps of each "
                               "batch-size bucket (1, 2, 4, 8, 16, 24, 32, 48, 64, then "
                               "every 32 up to max_num_seqs).")
    num_threads: int | None = knob(None, "Torch threads on CPU (of each tensor-parallel "
                                   "rank); defaults to the cores available to this process, "
                                   "shared among its data-parallel cores and their ranks.")
    reuse_host_memory: bool = knob(True, "On CPU: keep freed host memory in the process "
                                   "for reuse (glibc's malloc: no mmap'd chunks, up to 1 GiB "
                                   "of freed heap kept) so a step's large tensors reuse pages "
                                   "instead of faulting in fresh zeroed ones (a 2,000-token "
                                   "prefill of a 1B model ~1.25x faster); the heap then "
                                   "holds up to about twice the largest step's tensors. "
                                   "false: glibc's defaults.")
    omp_spin_count: int | None = knob(None, "GOMP_SPINCOUNT of a server's local engine-core "
                                      "processes (unless set in the environment): how long an "
                                      "idle OpenMP thread spins before it sleeps. A short spin "
                                      "(e.g. 10000) gives the CPU back to other processes "
                                      "sharing its cores, which helps when several engine "
                                      "cores or other busy processes share one CPU, and costs "
                                      "some speed on small batches. Unset: libgomp's "
                                      "default, except pipeline stages taking turns (one "
                                      "step in flight) and their ranks: 10000, so that a "
                                      "waiting stage gives its cores to the computing one "
                                      "(an offline LLM's rank 0 runs in the caller's "
                                      "process: set there if torch is not loaded yet).")
    fp32_gemm_rows: int | None = knob(None, "On CPU in bf16: steps of at least this many "
                                      "tokens multiply float32 copies of the projection "
                                      "weights (the same bf16 values). For CPUs whose bf16 "
                                      "matrix multiply is slower than their float32 one once "
                                      "a step has more than a few rows (no AMX; Intel's "
                                      "AVX512-BF16); the copies take twice the bf16 weights' "
                                      "memory. Unset: 16 there, off where bf16 wins (AMX, or "
                                      "AVX512-BF16 on AMD: Zen 4 on); 0: off.")
    max_forward_tokens: int | None = knob(None, "Most tokens one forward pass computes: a "
                                          "step with more runs in several passes (whole "
                                          "sequences, prefills first). On CPU, passes of "
                                          "bounded size keep the activations in the CPU's "
                                          "caches, which speeds up large prefill steps. Unset: "
                                          "1024 on CPU, no limit on GPU; 0: no limit.")
    step_profile_seconds: float = knob(10.0, "Most seconds the engine spends timing steps "
                                       "of a grid of shapes when no profile of this model on "
                                       "this machine is saved yet: three small shapes before "
                                       "it serves, the rest one at a time while it idles, "
                                       "then saved. They seed the step-time model that sizes "
                                       "steps (max_step_ms) and the slo policy's plans. 0: "
                                       "none; the model learns from served steps alone.")
    profiler_dir: str | None = knob(None, "Folder that POST /start_profile's torch.profiler "
                                    "traces go to, one Chrome trace per engine core and run "
                                    "(vLLM's VLLM_TORCH_PROFILER_DIR); unset: /start_profile "
                                    "is refused.")
    log_stats_interval: float = knob(1.0, "Seconds between an engine core's status lines "
                                     "(queues, KV use, prefix hits, tokens/s) while it has "
                                     "work; 0: none (vLLM's --disable-log-stats).")
    log_level: str = knob("info", "Level of tidal's own log lines in the server and its "
                          "engine cores: debug, info, warning, error or critical (SGLang's "
                          "--log-level; uvicorn's follow --uvicorn-log-level).")
    cpu_decoder: bool = knob(True, "On CPU, run decode-only steps of bf16 or float32 models "
                             "without q/k norms (Llama, Mistral, Qwen2, Phi-3) as one call "
                             "into tidal's C++ decoder, every decode attention over the "
                             "paged cache in place, and the other steps' norms, RoPE, KV "
                             "writes and SiLU x up as its fused loops. The extension is "
                             "compiled once, on first use (that start takes longer); without "
                             "a compiler, PyTorch ops run instead. false: always PyTorch ops.")
    deterministic: bool = knob(False, "Batch-invariant inference on CPU: a request's tokens "
                               "and logprobs (greedy, or sampled with a seed) do not depend "
                               "on the other requests of its steps, on prefix-cache hits, on "
                               "how its prompt is chunked, on preemption or on speculation. "
                               "Dense projections run in calls of 16 rows, GGUF ones on their "
                               "integer kernels at any size, every attention row through one "
                               "C++ kernel: slower (docs/design/deterministic.md). Needs the "
                               "C++ extension; not with routed experts, soft-capped attention, "
                               "tensor or pipeline parallelism, or trees of guesses.")
    generation_config: str = knob("auto", "Sampling defaults for the fields a request leaves "
                                  "unset (temperature, top_p, top_k, min_p, "
                                  "repetition_penalty; max_new_tokens: the output limit): "
                                  "'auto' from the model's generation_config.json (a GGUF's "
                                  "general.sampling.*), a folder's path from its "
                                  "generation_config.json, 'vllm' (or 'tidal') none. The "
                                  "model's end-of-turn tokens end generations either way.")
    override_generation_config: str | None = knob(None, "A JSON object over the generation "
                                                  "config's sampling defaults, e.g. "
                                                  "'{\"temperature\": 0.5}' (vLLM's).")

    def __post_init__(self) -> None:
        parse_overrides(self.override_generation_config)  # a ValueError names the field
        check_choice("dtype", self.dtype, ("auto", "bfloat16", "float16", "float32"))
        if self.device not in ("auto", "cpu", "cuda") and not (
                self.device.startswith("cuda:") and self.device[5:].isdigit()):
            raise ValueError(f"device must be auto, cpu, cuda or cuda:N; got {self.device!r}")
        for name, allowed in (("quantization", QUANTIZATIONS),
                              ("kv_cache_dtype", KV_CACHE_DTYPES),
                              ("logprobs_mode", LOGPROBS_MODES), ("log_level", LOG_LEVELS),
                              ("prompt_rounding", ("twice", "once")),
                              ("load_format", ("auto", "dummy"))):
            check_choice(name, getattr(self, name), allowed)
        if self.fp32_gemm_rows is not None and self.fp32_gemm_rows < 0:
            raise ValueError("fp32_gemm_rows must be >= 0")
        if self.max_forward_tokens is not None and self.max_forward_tokens < 0:
            raise ValueError("max_forward_tokens must be >= 0")
        if self.omp_spin_count is not None and self.omp_spin_count < 0:
            raise ValueError("omp_spin_count must be >= 0")
        if self.step_profile_seconds < 0:
            raise ValueError("step_profile_seconds must be >= 0")
        if self.log_stats_interval < 0:
            raise ValueError("log_stats_interval must be >= 0")
        if not 0 < self.kv_cache_fraction < 1:
            raise ValueError("kv_cache_fraction must be in (0, 1)")
        if self.kv_disk_size <= 0:
            raise ValueError(f"kv_disk_size must be > 0 GiB, got {self.kv_disk_size}")
        if self.kv_host_memory < 0:
            raise ValueError(f"kv_host_memory must be >= 0 GiB, got {self.kv_host_memory}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError("gpu_memory_utilization must be in (0, 1]")


DEFAULT_SPECULATIVE_TOKENS = 4  # with a method given and no num_speculative_tokens


@dataclass(frozen=True)
class SpeculativeConfig:
    """Who guesses the tokens speculative decoding verifies (the scheduler's
    num_speculative_tokens and speculative_adaptive say how many)."""

    speculative_method: str | None = knob(
        None, "'ngram' (prompt lookup over the request's own tokens), 'suffix' (suffix "
        "decoding over its tokens and recent requests' outputs) or 'draft' (a smaller model "
        "with the same tokenizer, speculative_model, decoding greedily); unset: no "
        f"speculation. With a method, num_speculative_tokens defaults to "
        f"{DEFAULT_SPECULATIVE_TOKENS}.")
    speculative_model: str | None = knob(
        None, "(draft) The draft model: an embedded name, a Hugging Face folder or a GGUF "
        "file, with the target's tokenizer. It runs in the target's dtype and quantization "
        "options; its KV shares the target's blocks (each block holds both).")
    speculative_branches: int = knob(
        1, "(ngram, suffix) Candidate continuations a proposer offers at each guessed "
        "position: 1 guesses one path; more grow a tree of them (ngram: the latest "
        "occurrences of the matched n-gram; suffix: the most frequent next tokens), of which "
        "one forward pass verifies the best num_speculative_tokens nodes and keeps the "
        "longest accepted path.")
    prompt_lookup_min: int = knob(2, "(ngram) Shortest n-gram looked up.")
    prompt_lookup_max: int = knob(4, "(ngram) Longest n-gram looked up (tried first).")
    suffix_max_depth: int = knob(8, "(suffix) Longest context matched, in tokens.")
    suffix_min_prob: float = knob(0.1, "(suffix) Stop guessing once the product of the "
                                  "guessed tokens' frequencies falls under this.")
    suffix_cache_requests: int = knob(256, "(suffix) Finished requests whose outputs inform "
                                      "the guesses of later ones.")

    def __post_init__(self) -> None:
        if self.speculative_method not in (None, *METHODS):
            raise ValueError(f"speculative_method must be one of "
                             f"{', '.join(METHODS)}; got {self.speculative_method!r}")
        if (self.speculative_method == "draft") != (self.speculative_model is not None):
            raise ValueError("speculative_model names the draft model of speculative_method "
                             "'draft', and that method needs one")
        if self.speculative_branches < 1:
            raise ValueError(f"speculative_branches must be >= 1; got "
                             f"{self.speculative_branches}")
        if self.speculative_branches > 1 and self.speculative_method == "draft":
            raise ValueError("speculative_branches > 1 grows trees of ngram or suffix "
                             "guesses; a draft model guesses one path")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError("prompt_lookup_min must be in [1, prompt_lookup_max]")
        if self.suffix_max_depth < 1 or self.suffix_cache_requests < 0:
            raise ValueError("suffix_max_depth must be >= 1 and suffix_cache_requests >= 0")
        if not 0 <= self.suffix_min_prob <= 1:
            raise ValueError("suffix_min_prob must be in [0, 1]")


def _lora_module(entry) -> str:
    """One lora_modules entry as name=path: given so, or as vLLM's JSON form
    {"name": ..., "path": ..., "base_model_name": ...} (the base model's name unused)."""
    entry = str(entry)
    if not entry.lstrip().startswith("{"):
        return entry
    try:
        spec = json.loads(entry)
        return f"{spec['name']}={spec['path']}"
    except (ValueError, KeyError, TypeError):
        raise ValueError(f"a JSON lora_modules entry names the adapter and its folder, "
                         f'{{"name": ..., "path": ...}}; got {entry!r}') from None


@dataclass(frozen=True)
class LoRAConfig:
    """Multi-LoRA serving: the adapters known from start and how many stay loaded (the
    scheduler's max_loras says how many a step may use)."""

    enable_lora: bool = knob(False, "Serve LoRA adapters over the base model: a request "
                             "names one (the OpenAI `model` field; `lora` in "
                             "SamplingParams). Implied by lora_modules.")
    lora_modules: tuple[str, ...] = knob((), "Adapters served from start, each name=path (a "
                                         "PEFT folder: adapter_config.json and "
                                         "adapter_model.safetensors) or vLLM's JSON form, "
                                         '{"name": ..., "path": ...}.')
    max_lora_rank: int = knob(16, "Largest rank an adapter may have; the adapter slots are "
                              "sized for it.")
    lora_dtype: str = knob("auto", "The adapter slots' dtype: 'auto' (the model's), "
                           "'bfloat16' (half the bytes a step reads per adapter, under a "
                           "float32 model too) or 'float32'.")
    max_cpu_loras: int | None = knob(None, "Adapters kept loaded in memory, least recently "
                                     "used out first (a request for another reloads it from "
                                     "its folder). Unset: max_loras, or every adapter of "
                                     "lora_modules if more.")

    def __post_init__(self) -> None:
        modules = self.lora_modules
        if isinstance(modules, str):  # "a=/x,b=/y", or one JSON entry
            modules = [modules] if modules.lstrip().startswith("{") else \
                modules.replace(",", " ").split()
        elif isinstance(modules, dict):
            modules = [f"{k}={v}" for k, v in modules.items()]
        modules = tuple(_lora_module(m) for m in modules)
        names = [m.partition("=")[0] for m in modules]
        for m, name in zip(modules, names):
            if not name or "=" not in m or not m.partition("=")[2]:
                raise ValueError(f"lora_modules entries are name=path; got {m!r}")
        if len(set(names)) != len(names):
            raise ValueError(f"lora_modules names an adapter twice: {names}")
        object.__setattr__(self, "lora_modules", modules)
        if modules and not self.enable_lora:
            object.__setattr__(self, "enable_lora", True)
        if self.max_lora_rank < 1:
            raise ValueError("max_lora_rank must be at least 1")
        if self.max_cpu_loras is not None and self.max_cpu_loras < 1:
            raise ValueError("max_cpu_loras must be at least 1")
        if self.lora_dtype not in ("auto", "bfloat16", "float32"):
            raise ValueError(f"lora_dtype must be auto, bfloat16 or float32; got "
                             f"{self.lora_dtype!r}")

    @property
    def modules(self) -> dict[str, str]:
        """lora_modules as {name: path}."""
        return dict(m.split("=", 1) for m in self.lora_modules)


@dataclass(frozen=True)
class EngineConfig:
    """The whole tree, one dataclass per layer."""

    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)

    def __post_init__(self) -> None:
        method, k = self.speculative.speculative_method, self.scheduler.num_speculative_tokens
        if k and method is None:
            raise ValueError("num_speculative_tokens needs a speculative_method to guess them")
        if method is not None and not k:
            raise ValueError(f"speculative_method={method!r} needs num_speculative_tokens >= 1")
        cpu_loras = self.lora.max_cpu_loras
        if self.lora.enable_lora and cpu_loras is not None and cpu_loras < self.scheduler.max_loras:
            raise ValueError(f"max_cpu_loras={cpu_loras} is under max_loras="
                             f"{self.scheduler.max_loras}: a step's adapters must all be loaded")
        tp, pp = self.parallel.tensor_parallel_size, self.parallel.pipeline_parallel_size
        if self.model.deterministic and tp * pp > 1:
            raise ValueError(f"--deterministic runs one process a model: not with "
                             f"--tensor-parallel-size {tp} --pipeline-parallel-size {pp}")
        if self.model.deterministic and self.speculative.speculative_branches > 1:
            raise ValueError("--deterministic verifies one path of guesses: "
                             "speculative_branches must be 1")
        if tp * pp > 1 and self.model.device not in ("auto", "cpu"):
            raise ValueError(f"--tensor-parallel-size {tp} --pipeline-parallel-size {pp}: "
                             f"ranks run on CPU for now (--device cpu)")
        if self.scheduler.batches_in_flight is None:  # a step in flight per stage, unless
            # async_scheduling runs one step ahead instead, or the stages share one
            # machine's cores (overlapped, they would split the cores a stage in turn has),
            # or it is a P/D instance (it moves KV between its steps)
            overlap = (pp > 1 and not self.parallel.one_machine
                       and self.scheduler.role == "mixed")
            depth = pp if overlap and not self.scheduler.async_scheduling else 1
            object.__setattr__(self, "scheduler", replace(self.scheduler,
                                                          batches_in_flight=depth))
        if pp > 1 and self.scheduler.steps_in_flight == 1 and self.model.omp_spin_count is None:
            # stages taking turns: a waiting stage's idle threads would spin on the cores
            # the computing stage needs
            object.__setattr__(self, "model", replace(self.model,
                                                      omp_spin_count=STAGE_SPIN_COUNT))
        if self.scheduler.batches_in_flight > pp:
            raise ValueError(f"batches_in_flight={self.scheduler.batches_in_flight} needs as "
                             f"many pipeline stages (--pipeline-parallel-size {pp})")
        if self.scheduler.batches_in_flight > 1 and self.scheduler.role != "mixed":
            raise ValueError(f"--batches-in-flight {self.scheduler.batches_in_flight}: a "
                             f"P/D instance (--role {self.scheduler.role}) reads and writes "
                             f"KV on every rank between its steps, so it runs one at a time")
        tiered = self.model.kv_cache_dir is not None or self.model.kv_host_memory > 0
        if tiered and method == "draft":
            flag = "--kv-cache-dir" if self.model.kv_cache_dir is not None else \
                "--kv-host-memory"
            raise ValueError(f"{flag}: the tiers below the pool store the model's KV, not "
                             f"a draft model's (speculate with ngram or suffix)")
        if method == "draft" and self.scheduler.role != "mixed":
            raise ValueError("a draft model needs the prompt's KV computed by the draft too; "
                             "a P/D pair speculates with ngram or suffix")

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> "EngineConfig":
        """Route flat keyword arguments to the dataclass that owns each field. The KV pool's
        size is `num_kv_blocks` (it becomes the cache's `num_blocks`); `num_blocks` is not
        an engine option. The policies' options go to the scheduler, which takes those of
        its policy and refuses another's."""
        parts: dict[str, dict[str, Any]] = {f.name: {} for f in fields(cls)}
        owners = {}
        for part in fields(cls):
            for f in fields(part.default_factory()):  # type: ignore[misc]
                owners.setdefault(f.name, part.name)
        owners.pop("policy_options")  # set by the options' own names
        owners.update(dict.fromkeys(option_fields(), "scheduler"))
        for key, value in kwargs.items():
            if key == "num_blocks":
                raise TypeError("num_blocks is not an engine option: the KV pool's size is "
                                "num_kv_blocks (--num-kv-blocks)")
            if key not in owners:
                raise TypeError(f"unknown engine option {key!r}")
            parts[owners[key]][key] = value
        model = ModelConfig(**parts["model"])
        cache_kwargs = dict(parts["cache"])
        if model.num_kv_blocks is not None:
            cache_kwargs["num_blocks"] = model.num_kv_blocks
        if parts["speculative"].get("speculative_method") is not None:
            parts["scheduler"].setdefault("num_speculative_tokens", DEFAULT_SPECULATIVE_TOKENS)
        return cls(model=model, cache=CacheConfig(**cache_kwargs),
                   scheduler=SchedulerConfig.from_kwargs(**parts["scheduler"]),
                   parallel=ParallelConfig(**parts["parallel"]),
                   speculative=SpeculativeConfig(**parts["speculative"]),
                   lora=LoRAConfig(**parts["lora"]))


def all_fields(only: tuple[str, ...] | None = None) -> list[tuple[str, Any, str]]:
    """(name, default, help) of every flat option (of the parts named in `only`), for the
    CLI (tidal/engine/flags.py) and docs/configuration.md. The cache's num_blocks is not
    one: the engine sets it from num_kv_blocks. The scheduler's are its own fields, then
    every policy's options, their help led by the policy's name in parentheses."""
    out = []
    for part in fields(EngineConfig):
        if only is not None and part.name not in only:
            continue
        for f in fields(part.default_factory()):  # type: ignore[misc]
            if (part.name, f.name) in (("cache", "num_blocks"), ("scheduler", "policy_options")):
                continue  # num_kv_blocks sets the one; the other is set option by option
            out.append((f.name, f.default, f.metadata.get("help", "")))
        if part.name == "scheduler":
            out += [(name, f.default, f"({policy} policy) {f.metadata.get('help', '')}")
                    for name, (policy, f) in option_fields().items()]
    return out


def option_type(name: str) -> type:
    """The type an option's value takes: its annotation, without `| None` (int for an
    `int | None` field), so the CLI can parse flags whose default is None."""
    holders = [part.default_factory for part in fields(EngineConfig)]
    for holder in holders + [cls.Options for cls in POLICIES.values()]:
        hints = typing.get_type_hints(holder)  # type: ignore[arg-type]
        if name in hints:
            kinds = [t for t in typing.get_args(hints[name]) if t is not type(None)]
            return kinds[0] if kinds else hints[name]
    raise KeyError(name)


def give_omp_spin(model: ModelConfig) -> None:
    """This process's libgomp reads GOMP_SPINCOUNT once, as torch loads: set the model
    config's `omp_spin_count` there before that (a value the environment already holds
    stays). Processes spawned after inherit it."""
    if model.omp_spin_count is not None:
        os.environ.setdefault("GOMP_SPINCOUNT", str(model.omp_spin_count))
