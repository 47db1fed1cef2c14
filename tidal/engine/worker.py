"""A worker: one device and what lives on it (the model's weights, its KV cache tensors, the
LoRA slots, the guesser of speculative decoding) and the `ModelRunner` that runs steps on
them. The executor hands it each step's plan."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

import msgspec
import torch

from tidal.core import ModelOutput, SamplingParams, SchedulerConfig, SchedulerOutput
from tidal.core.kv_tiers import TierReport
from tidal.core.outputs import KVLoad
from tidal.engine.config import EngineConfig, LoRAConfig, ModelConfig, SpeculativeConfig
from tidal.engine.decode_graphs import CudaGraphCapture
from tidal.engine.device import pick_device, pick_kv_cache_dtype
from tidal.engine.host_memory import keep_freed_memory
from tidal.engine.kv_cache import KVCache, kv_blocks
from tidal.engine.kv_disk import DiskKVTier, tier_folder
from tidal.engine.kv_host import HostKVTier
from tidal.engine.lora_manager import LoRAManager
from tidal.engine.model_loading import load_for_runner, pick_model_dtype
from tidal.engine.model_runner import ModelRunner
from tidal.engine.parallel_config import busy_ranks
from tidal.engine.phases import Phases
from tidal.model import cpu_decode
from tidal.model.attention import AttentionMetadata, PrefillSeq, TorchAttention
from tidal.model.batch_invariant import check_supported
from tidal.model.config import ModelArch, stage_layers
from tidal.model.kernels import (FusedKernels, cpu_fused_kernels, fused_kernels, lora_kernel,
                                 paged_decode_kernel, paged_prefill_kernel)
from tidal.model.kv_quant import KVFormat
from tidal.model.pooling import Pooling
from tidal.model.score_head import ScoreHead
from tidal.model.registry import model_files
from tidal.model.sampler import on_device
from tidal.model.tensor_parallel import Shard, TPGroup
from tidal.model.tokenizer import Tokenizer, tokenizer_folder
from tidal.spec.factory import make_guesser

log = logging.getLogger("tidal.engine")
# Host memory a thread keeps for reading tier blocks into (a load of more reads in rows of it)
STAGING_BYTES = 16 << 20


@dataclass(frozen=True)
class WorkerInfo:
    """What the engine core and the step-time profile need to know of a worker."""

    arch: ModelArch
    device: str
    dtype: torch.dtype
    quantization: str | None  # the weights' format as served
    num_blocks: int  # the KV pool's blocks (the scheduler's)
    block_size: int
    kv_cache_bytes: int
    max_forward_tokens: int  # tokens a forward pass takes at most (0: any)
    decoder: bool  # decode steps run through the C++ decoder
    matryoshka: bool  # an embedding's leading dimensions are one too (`dimensions` works)
    phases: Phases  # where its start's seconds went
    tier_capacity: int = 0  # blocks the tiers below the pool hold at most (0: no tier)
    tier_keys: tuple[bytes, ...] = ()  # the blocks they hold at start, oldest first
    kv_cache_dtype: str = "auto"  # the KV rows' format (tidal.model.kv_quant)
    scorer: str = ""  # the model's score head, by kind (tidal.model.score_head); "": none
    labels: tuple[str, ...] = ()  # a classifier head's labels (one: a reranker's score)

    @property
    def on_gpu(self) -> bool:
        return self.device.startswith("cuda")


class Worker:
    """Loads the model onto its device and sizes its KV cache; `execute` applies a step's
    block copies and runs the step."""

    def __init__(self, folder: str | Path, config: ModelConfig, block_size: int,
                 scheduler: SchedulerConfig | None = None,
                 speculative: SpeculativeConfig | None = None,
                 lora: LoRAConfig | None = None, tp: TPGroup | None = None,
                 expert_parallel: bool = False) -> None:
        """`tp`: this worker is one rank of a tensor-parallel group (of a pipeline stage)
        and holds its share of the model (of the stage's layers), and of every KV block
        (its key/value heads, of those layers); `expert_parallel`: its share of the routed
        experts is 1/N of them whole."""
        sched = scheduler or SchedulerConfig()  # the step sizes to plan memory and graphs for
        phases = Phases()  # where the start's seconds go, for the log
        self.device = device = pick_device(config.device)
        on_gpu = device.startswith("cuda")
        if tp is not None and on_gpu:
            raise ValueError(f"--tensor-parallel-size {tp.size}: ranks run on CPU for now "
                             f"(--device cpu)")
        whole = ModelArch.from_folder(folder)
        ranks = tp.local if tp is not None else 1  # this machine's share of the group
        shard = None
        if tp is not None:  # its part of each tensor, of its pipeline stage's layers
            links = tp.links
            layers = links and stage_layers(whole.num_layers, links.stages, links.stage)
            if links:
                links.vocab = whole.vocab_size  # the width of the logits it may be sent
            shard = Shard(tp.rank, tp.size, whole, expert_parallel, layers)
        self.arch = arch = shard.computed if shard else whole
        self.block_size = block_size
        quantization, self.dtype = pick_model_dtype(folder, arch, config, device)
        if on_gpu:
            if ":" in device:  # cuda:N: this process's current device too
                torch.cuda.set_device(torch.device(device))
        else:  # the ranks computing at once on one machine share its cores (stages taking
            # turns leave theirs idle)
            busy = 1 if tp is None else busy_ranks(tp.local, tp.size, sched.steps_in_flight)
            torch.set_num_threads(config.num_threads
                                  or max(1, len(os.sched_getaffinity(0)) // busy))
            if config.reuse_host_memory:
                keep_freed_memory()
        max_model_len = min(sched.max_model_len, arch.context_length)
        if config.deterministic:
            check_supported(arch, device, self.dtype)
        ext = (cpu_decode.extension() if (config.cpu_decoder or config.deterministic)
               and device == "cpu" else None)
        phases.done("C++ extension")
        # the C++ paged attention and lora_add run float32 and bfloat16; float16 rows on CPU
        # take PyTorch's attention and matmuls
        cpp = ext if ext is not None and self.dtype != torch.float16 else None
        self.kv_format = kv_format = KVFormat(
            pick_kv_cache_dtype(config.kv_cache_dtype, device, quantization, self.dtype))
        if kv_format.storage(self.dtype).itemsize > self.dtype.itemsize:
            raise ValueError(f"--kv-cache-dtype {kv_format.name} holds more than the model's "
                             f"{str(self.dtype).split('.')[-1]} values: use it with --dtype "
                             "float32")
        paged = cpp.paged_decode_attention if cpp else (
            paged_decode_kernel() if on_gpu else None)
        if config.deterministic and cpp is None:
            raise ValueError("--deterministic needs tidal's C++ extension (a C++ compiler; "
                             "tidal.model.cpu_extension)")
        prefill, fresh = (
            (paged_prefill_kernel(), None) if on_gpu
            else (cpp.paged_prefill_attention, 0) if config.deterministic  # every row: one kernel
            else cpu_decode.prefill_kernel(cpp, kv_format.storage(self.dtype), self.dtype))
        backend = TorchAttention.for_arch(arch, paged, prefill, kv_format)
        backend.fresh_kernel_scores = fresh
        backend.batch_invariant = config.deterministic
        self.model, decoder = load_for_runner(folder, whole, config, device, self.dtype,
                                              quantization, backend, ext, tp, shard)
        self.lora = None if lora is None or not lora.enable_lora else LoRAManager(
            lora, sched.max_loras, arch, self.model, self.dtype, device,
            lora_kernel() if on_gpu else cpp.lora_add if cpp else None, decoder, shard)
        method = speculative.speculative_method if speculative is not None else None
        guesses = sched.num_speculative_tokens if method else 0
        guesser = make_guesser(speculative, guesses, Path(folder), config, device,
                               ext) if guesses else None
        pooling = Pooling.from_folder(folder)
        tokenizer_at = tokenizer_folder(config.tokenizer, folder)  # --tokenizer's, or the model's
        head = ScoreHead.of(folder, self.model, self.dtype,
                            lambda text: Tokenizer(tokenizer_at).encode(text, False),
                            config.score_tokens)
        if head is not None:
            pooling = replace(pooling, head=head)
        phases.done("weights")
        if arch.gemma:  # Gemma's offset norms keep the eager ops
            pass
        elif on_gpu and kv_format.storage(self.dtype) == self.dtype:
            # (the Triton RoPE writes the model's dtype to the cache)
            self._use_fused_kernels(fused_kernels())
        elif cpp is not None:
            self._use_fused_kernels(cpu_fused_kernels(cpp))
        max_forward = (config.max_forward_tokens if config.max_forward_tokens is not None
                       else 1024 if device == "cpu" else 0)
        per_block = kv_format.bytes_per_token(arch, self.dtype) * block_size
        if guesser is not None:  # a block holds a draft's KV of its positions too
            per_block += guesser.block_bytes(block_size)
        step_tokens = min(sched.max_input_tokens_per_step, max_model_len)
        # Ranks on one machine share its memory: each budgets for all of their shares.
        num_blocks = kv_blocks(config, per_block * ranks, device,
                               lambda: self._peak_step(step_tokens, sched.max_num_seqs))
        if tp is not None:
            num_blocks = tp.min(num_blocks)  # every rank holds every block table's blocks
        self.kv = KVCache(arch, num_blocks, block_size, self.dtype, device, kv_format)
        self.tier = disk = None if config.kv_cache_dir is None else DiskKVTier(
            tier_folder(config.kv_cache_dir, {
                "model": model_files(folder), "dtype": str(self.dtype), "quantization":
                quantization, "kv_cache_dtype": kv_format.name,
                "block": [len(self.kv.layers), *self.kv.layers[0][0].shape[1:]],
                "shard": None if shard is None else [shard.rank, shard.size, repr(
                    shard.layers)]}),  # a rank's or stage's share of every block
            self.kv.block_nbytes, int(config.kv_disk_size * 2**30))
        if config.kv_host_memory:  # above the disk tier: its hot blocks in host memory
            self.tier = HostKVTier(self.kv.block_nbytes, int(config.kv_host_memory * 2**30),
                                   pinned=on_gpu, below=disk)
        # loads from it run beside the step's forward pass, which reads none of their blocks
        self._loader = ThreadPoolExecutor(1, "tidal-kv-load") if self.tier else None
        self._staged = threading.local()  # inline loads read on this thread, others there
        self._loaded: deque = deque()  # launched steps' loads (counts, seconds), oldest first
        phases.done("KV cache")
        if guesser is not None:
            guesser.allocate(num_blocks + 1, block_size)
        self.guesser = guesser
        self.runner = ModelRunner(self.model, decoder, self.kv, backend, tokenizer_at, arch,
                                  config.seed, max_forward, guesser, self.lora, pooling,
                                  config.logits_processors, config.logprobs_mode)
        if on_gpu and not config.enforce_eager and backend.paged_kernel is not None:
            self.runner.use_decode_graphs(CudaGraphCapture(), sched.max_num_seqs,
                                          max_model_len)
        phases.done("runner")
        if tp is not None and tp.links is not None:  # warmed up: later steps may overlap
            tp.links.pipelined = sched.steps_in_flight > 1
        self.info = WorkerInfo(arch, device, self.dtype, quantization, num_blocks, block_size,
                               self.kv.nbytes, max_forward, decoder is not None,
                               pooling.matryoshka, phases,
                               self.tier.capacity if self.tier else 0,
                               tuple(self.tier.keys()) if self.tier else (), kv_format.name,
                               head.kind if head is not None else "",
                               head.labels if head is not None else ())

    @classmethod
    def from_config(cls, config: EngineConfig, folder: str | Path,
                    tp: TPGroup | None = None) -> "Worker":
        """The worker an engine's config asks for (this rank's, with `tp`)."""
        return cls(folder, config.model, config.cache.block_size, config.scheduler,
                   config.speculative, config.lora, tp=tp,
                   expert_parallel=config.parallel.enable_expert_parallel)

    @torch.inference_mode()
    def _peak_step(self, tokens: int, rows: int) -> None:
        """The largest step's forward pass (one prefill of `tokens`, `rows` logits rows) over
        a one-block cache: its peak memory is what the KV cache must leave free."""
        arch = self.arch
        fmt = self.kv_format
        shape = fmt.cache_shape(1, self.block_size, arch.num_kv_heads, arch.head_dim)
        caches = [(torch.zeros(shape, dtype=fmt.storage(self.dtype), device=self.device),) * 2
                  for _ in range(arch.num_layers)]
        zeros = torch.zeros(tokens, dtype=torch.long, device=self.device)
        meta = AttentionMetadata(zeros, [PrefillSeq(0, tokens, 0)], tokens)
        rows_t = torch.arange(tokens - min(rows, tokens), tokens, device=self.device)
        self.model(zeros, torch.arange(tokens, device=self.device), caches, meta, rows_t)

    def _use_fused_kernels(self, kernels: FusedKernels | None) -> None:
        """Fused norm and RoPE kernels (Triton's, or the C++ extension's on CPU), kept if a
        tiny forward pass runs with them (they compile for this device)."""
        self.model.kernels = kernels
        if self.model.kernels is not None:
            try:
                self._peak_step(2, 1)
            except Exception as exc:
                log.warning("fused kernels failed (%s); running PyTorch ops", exc)
                self.model.kernels = None

    # ------------------------------------------------------------------ steps
    @torch.inference_mode()
    def prepare(self, out: SchedulerOutput) -> tuple[dict[str, int], float]:
        """A step's moves before its forward pass: store its blocks to the tiers below the
        pool (before any copy or forward pass can overwrite them), copy its blocks
        (copy-on-write of shared prefixes), then load its inline blocks from the tiers; how
        many leading blocks each inline load read whole, and the seconds they took."""
        if out.kv_stores:
            for (_, key), data in zip(out.kv_stores, self.kv.block_bytes(
                    [b for b, _ in out.kv_stores])):
                self.tier.store(key, data)
        self._copy_blocks(out)
        if not out.kv_loads:  # most steps
            return {}, 0.0
        return self._load_blocks([x for x in out.kv_loads if x.inline])

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput,
                prepared: tuple[dict[str, int], float] | None = None) -> ModelOutput:
        """`prepare` the step (unless an executor did, on every rank, and passes the inline
        loads' counts its ranks agree on), then run it without a request whose inline load
        failed, loading its other blocks from the tiers meanwhile."""
        loaded, seconds = self.prepare(out) if prepared is None else prepared
        if not out.kv_loads:  # most steps
            return self.runner.execute(out)
        failed = {x.request_id for x in out.kv_loads if x.inline
                  and loaded[x.request_id] < len(x.keys)}
        beside = [x for x in out.kv_loads if not x.inline]
        loading = self._loader.submit(self._load_blocks, beside) if beside else None
        result = self.runner.execute(msgspec.structs.replace(out, scheduled=[
            x for x in out.scheduled if x.request_id not in failed]) if failed else out)
        if loading is not None:
            more, more_seconds = loading.result()
            loaded = {**loaded, **more}
            seconds += more_seconds
        result.kv_loaded, result.kv_load_seconds = loaded, seconds
        return result

    def _load_blocks(self, loads: list[KVLoad]) -> tuple[dict[str, int], float]:
        """Each load's blocks read from the tiers in order, up to the first missing or
        corrupt one: how many loaded whole per request, and the seconds it all took."""
        if not loads:  # a step whose loads all run beside it: no rows on this thread
            return {}, 0.0
        t0, loaded = time.perf_counter(), {}
        rows = self._staging()
        for load in loads:
            whole = 0  # read rows of them, each row then written to the pool a layer at a time
            for start in range(0, len(load.keys), len(rows)):
                keys, n = load.keys[start:start + len(rows)], 0
                while n < len(keys) and self.tier.load_into(keys[n], rows[n]):
                    n += 1
                if n:
                    self.kv.write_rows(load.block_ids[start:start + n], rows[:n])
                whole += n
                if n < len(keys):  # a missing or corrupt block ends the load
                    break
            loaded[load.request_id] = whole
        return loaded, time.perf_counter() - t0

    def _staging(self) -> torch.Tensor:
        """This thread's rows of host memory that blocks are read into (pinned for a GPU
        pool: one DMA), STAGING_BYTES of them (at least one block), kept from load to
        load: fresh pages would fault in on every read, as much time as the read."""
        rows = getattr(self._staged, "rows", None)
        if rows is None:
            count = max(1, STAGING_BYTES // self.kv.block_nbytes)
            rows = self._staged.rows = torch.empty(
                (count, self.kv.block_nbytes), dtype=torch.uint8,
                pin_memory=str(self.kv.device).startswith("cuda"))
        return rows

    def tier_report(self) -> TierReport:
        """Blocks other engine cores wrote to the disk tier's folder or deleted since the
        last call; host memory's figures."""
        return self.tier.report() if self.tier is not None else TierReport()

    def close(self) -> None:
        """Write the disk tier's pending blocks out."""  # the host tier's die with it
        if self.tier is not None:
            self.tier.close()
            self._loader.shutdown()

    def launch(self, out: SchedulerOutput) -> dict[str, int] | None:
        """`execute`'s start: its output is a later `complete`'s, steps completing in the
        order they started (pipeline stages keep several in flight). Its loads are all
        beside it (a step ahead plans none inline), read while this rank's forward pass
        runs: how many blocks each loaded whole (for rank 0, before the completion)."""
        self.prepare(out)
        loading = (self._loader.submit(self._load_blocks, out.kv_loads) if out.kv_loads
                   else None)
        try:
            self.runner.launch(out)
        finally:
            loaded = loading.result() if loading is not None else None
        self._loaded.append(loaded)
        return loaded[0] if loaded is not None else None

    def complete(self) -> ModelOutput:
        """The output of the oldest step launched and not yet completed."""
        loaded = self._loaded.popleft()
        result = self.runner.complete(self.runner.launched[0])
        if loaded is not None:
            result.kv_loaded, result.kv_load_seconds = loaded
        return result

    def _copy_blocks(self, out: SchedulerOutput) -> None:
        if out.block_copies:
            dev = torch.device(self.device)  # staged without a sync, as the sampler's inputs
            src = on_device([s for s, _ in out.block_copies], torch.long, dev)
            dst = on_device([d for _, d in out.block_copies], torch.long, dev)
            self.kv.copy_blocks(src, dst)
            if self.guesser is not None:
                self.guesser.copy_blocks(src, dst)

    def forget(self, rid: str, finished: bool = False) -> None:
        self.runner.forget(rid, finished)

    def compile_constraint(self, params: SamplingParams) -> None:
        self.runner.compile_constraint(params)

    def read_blocks(self, block_ids: list[int]) -> tuple[bytes, list[int], str]:
        return self.kv.read_blocks(block_ids)

    def touch_kv_cache(self, block_ids: list[int]) -> None:
        self.kv.touch(block_ids)

    def write_blocks(self, block_ids: list[int], data: bytes, shape: list[int],
                     dtype: str) -> None:
        self.kv.write_blocks(block_ids, data, shape, dtype)

    # ------------------------------------------------------------------ LoRA adapters
    def adapters(self) -> dict[str, str] | None:
        """The adapters requests may name (name -> folder); None where LoRA is off."""
        return None if self.lora is None else dict(self.lora.paths)

    def register_adapter(self, name: str, path: str) -> None:
        """Let requests name the adapter in `path` (LoRAError if it cannot be served)."""
        self.lora.register(name, path)

    def unregister_adapter(self, name: str) -> None:
        self.lora.unregister(name)

    def load_adapter(self, name: str) -> None:
        """Read a registered adapter from its folder now, if it is not in memory."""
        self.lora.load(name)
