"""Executes a SchedulerOutput on the model: builds the flattened batch, runs the forward
pass over the paged KV cache, samples, and returns a ModelOutput."""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

import torch

from tidal.core import (ModelOutput, NewRequest, PromptLogprob, SamplingParams, SchedulerConfig,
                        SchedulerOutput)
from tidal.core.kv_cache_manager import cdiv
from tidal.core.request import token_slice
from tidal.engine.batch import BatchBuilder, StepBatch, forward
from tidal.engine.config import LoRAConfig, ModelConfig, SpeculativeConfig
from tidal.engine.decode_graphs import CaptureBackend, CudaGraphCapture, DecodeGraphs
from tidal.engine.device import free_ram, gpu_kv_budget, pick_device
from tidal.engine.draft import DraftModel, check_same_tokenizer
from tidal.engine.lora_manager import LoRAManager
from tidal.engine.model_loading import load_for_runner, pick_model_dtype
from tidal.engine.speculator import Speculator, accepted_run
from tidal.engine.step_inputs import StepInputs
from tidal.engine.structured import Grammars, Matchers
from tidal.model import cpu_decode
from tidal.model.attention import AttentionMetadata, PrefillSeq, TorchAttention, kv_cache_shape
from tidal.model.config import ModelArch
from tidal.model.kernels import (fused_kernels, lora_kernel, paged_decode_kernel,
                                 paged_prefill_kernel)
from tidal.model.pooling import Pooling
from tidal.model.registry import resolve_model
from tidal.model.sampler import (SampleRow, needs_penalty, on_device, sample,
                                 target_logprobs)

log = logging.getLogger("tidal.engine")


class _Seq:
    """The runner's copy of a request: what sampling needs, the tokens it sampled, and the
    prompt logprobs and pooled hidden states it has gathered so far while they are owed."""

    __slots__ = ("prompt", "output", "params", "stop_ids", "num_samples", "prompt_k",
                 "prompt_entries", "embed", "pooled")

    def __init__(self, new: NewRequest) -> None:
        self.prompt = new.prompt_token_ids
        self.output = list(new.output_token_ids)  # grows by what this runner samples
        self.params = new.sampling_params
        self.stop_ids = new.stop_token_ids
        self.num_samples = new.num_samples
        # Owed until the first output token: a request back with output reported them already.
        owed = new.sampling_params.prompt_logprobs is not None and not new.output_token_ids
        self.prompt_k = new.sampling_params.prompt_logprobs if owed else None
        # one per prompt position computed so far; None for position 0
        self.prompt_entries: list[PromptLogprob | None] = []
        # SamplingParams.embed while the embedding is owed (as prompt logprobs are)
        self.embed = new.sampling_params.embed if not new.output_token_ids else None
        self.pooled: tuple[torch.Tensor, int] | None = None  # Pooling.add's state

    def tokens(self, start: int, end: int) -> list[int]:
        return token_slice(self.prompt, self.output, start, end)


class ModelRunner:
    """Owns the model, the KV cache tensors, the requests' sampling state and their
    generators. It reads only the plain data of each SchedulerOutput: a request's prompt
    and parameters come with its first scheduled step, and the runner keeps the tokens it
    samples."""

    def __init__(self, folder: str | Path, config: ModelConfig, block_size: int,
                 scheduler: SchedulerConfig | None = None,
                 speculative: SpeculativeConfig | None = None,
                 lora: LoRAConfig | None = None) -> None:
        sched = scheduler or SchedulerConfig()  # the step sizes to plan memory and graphs for
        self.device = pick_device(config.device)
        self.on_gpu = self.device.startswith("cuda")
        self.arch = ModelArch.from_folder(folder)
        quantization, self.dtype = pick_model_dtype(folder, self.arch, config, self.device)
        self.quantization = quantization  # the weights' format as served
        if self.on_gpu:
            if ":" in self.device:  # cuda:N: this process's current device too
                torch.cuda.set_device(torch.device(self.device))
        else:
            torch.set_num_threads(config.num_threads or len(os.sched_getaffinity(0)))
        max_model_len = min(sched.max_model_len, self.arch.context_length)
        ext = cpu_decode.extension() if config.cpu_decoder and self.device == "cpu" else None
        # the C++ paged attention and lora_add run float32 and bfloat16; float16 rows on CPU
        # take PyTorch's attention and matmuls
        cpp = ext if ext is not None and self.dtype != torch.float16 else None
        paged = cpp.paged_decode_attention if cpp else (
            paged_decode_kernel() if self.on_gpu else None)
        backend = TorchAttention.for_arch(self.arch, paged,
                                          paged_prefill_kernel() if self.on_gpu else None)
        self.model, self.decoder = load_for_runner(folder, self.arch, config, self.device,
                                                   self.dtype, quantization, backend, ext)
        self.lora = None if lora is None or not lora.enable_lora else LoRAManager(
            lora, sched.max_loras, self.arch, self.model, self.dtype, self.device,
            lora_kernel() if self.on_gpu else cpp.lora_add if cpp else None, self.decoder)
        method = speculative.speculative_method if speculative is not None else None
        self.max_guesses = sched.num_speculative_tokens if method else 0
        self.draft: DraftModel | None = None
        if self.max_guesses and method == "draft":
            draft_folder = resolve_model(speculative.speculative_model)[0]
            check_same_tokenizer(Path(folder), draft_folder)
            self.draft = DraftModel(draft_folder, config, self.device, ext)
        self.block_size = block_size
        self.folder = Path(folder)
        self.pooling = Pooling.from_folder(folder)
        self.matchers: Matchers | None = None  # structured outputs, made on first use
        self._matchers_lock = threading.Lock()
        if self.on_gpu and not self.arch.gemma:  # Gemma's offset norms keep the eager ops
            self._use_fused_kernels()
        self.max_forward_tokens = (config.max_forward_tokens if config.max_forward_tokens
                                   is not None else 1024 if self.device == "cpu" else 0)
        self.num_blocks = self._size_kv(config, min(sched.max_input_tokens_per_step,
                                                    max_model_len), sched.max_num_seqs)
        # One block more than the pool's: the null block, which padded rows read and write.
        self.null_block = self.num_blocks
        shape = kv_cache_shape(self.num_blocks + 1, block_size, self.arch.num_kv_heads,
                               self.arch.head_dim)
        self.kv_caches = [(torch.zeros(shape, dtype=self.dtype, device=self.device),
                           torch.zeros(shape, dtype=self.dtype, device=self.device))
                          for _ in range(self.arch.num_layers)]
        self._k_caches = [k for k, _ in self.kv_caches]
        self._v_caches = [v for _, v in self.kv_caches]
        if self.draft is not None:
            self.draft.allocate(self.num_blocks + 1, block_size)
        # Sampling draws its noise on the logits' device, so the generators live there.
        self.generator = torch.Generator(device=self.device).manual_seed(config.seed)
        self.generators: dict[str, list[torch.Generator]] = {}  # seeded: one per row
        self.seqs: dict[str, _Seq] = {}
        self.speculator = (Speculator(speculative, self.max_guesses)
                           if self.max_guesses and self.draft is None else None)
        self.batches = BatchBuilder(block_size, self.null_block, self.device, backend,
                                    StepInputs(self.device), self.max_forward_tokens)
        self.graphs: DecodeGraphs | None = None
        if self.on_gpu and not config.enforce_eager and backend.paged_kernel is not None:
            self.use_decode_graphs(CudaGraphCapture(), sched.max_num_seqs, max_model_len)

    def _size_kv(self, config: ModelConfig, step_tokens: int, max_seqs: int) -> int:
        per_block = self.arch.kv_bytes_per_token(self.dtype.itemsize) * self.block_size
        if self.draft is not None:  # a block holds the draft's KV of its positions too
            per_block += self.draft.block_bytes(self.block_size)
        if config.num_kv_blocks is not None:
            return config.num_kv_blocks
        if config.kv_cache_memory:
            budget = config.kv_cache_memory
        elif self.on_gpu:
            budget = gpu_kv_budget(self.device, config.gpu_memory_utilization,
                                   lambda: self._profile(step_tokens, max_seqs))
        else:
            budget = int(free_ram() * config.kv_cache_fraction)
        blocks = budget // per_block - 1  # the null block
        if blocks < 1:
            raise ValueError(f"KV cache budget of {budget} bytes holds no block of {per_block}")
        return blocks

    @torch.inference_mode()
    def _profile(self, tokens: int, rows: int) -> None:
        """The largest step's forward pass (one prefill of `tokens`, `rows` logits rows) over
        a one-block cache: its peak memory is what the KV cache must leave free."""
        shape = kv_cache_shape(1, self.block_size, self.arch.num_kv_heads, self.arch.head_dim)
        caches = [(torch.zeros(shape, dtype=self.dtype, device=self.device),) * 2
                  for _ in range(self.arch.num_layers)]
        zeros = torch.zeros(tokens, dtype=torch.long, device=self.device)
        meta = AttentionMetadata(zeros, [PrefillSeq(0, tokens, 0)], tokens)
        rows_t = torch.arange(tokens - min(rows, tokens), tokens, device=self.device)
        self.model(zeros, torch.arange(tokens, device=self.device), caches, meta, rows_t)

    def _use_fused_kernels(self) -> None:
        """Triton's norm and RoPE kernels, kept if a tiny forward pass runs with them (they
        compile for this device)."""
        self.model.kernels = fused_kernels()
        if self.model.kernels is not None:
            try:
                self._profile(2, 1)
            except Exception as exc:
                log.warning("fused kernels failed (%s); running PyTorch ops", exc)
                self.model.kernels = None

    @torch.inference_mode()
    def use_decode_graphs(self, backend: CaptureBackend, max_num_seqs: int,
                          max_model_len: int) -> None:
        """Capture decode steps of every batch-size bucket up to max_num_seqs; a capture
        that fails (a kernel that does not compile here) leaves every step eager."""
        graphs = DecodeGraphs(self.model, self.kv_caches, max_num_seqs,
                              cdiv(max_model_len, self.block_size), self.null_block,
                              self.block_size, self.device)
        try:
            graphs.capture(backend)
        except Exception as exc:
            if not self.on_gpu:
                raise
            log.warning("decode graph capture failed (%s); decoding eagerly", exc)
            return
        self.graphs = graphs

    @property
    def kv_cache_bytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in self.kv_caches)

    # ------------------------------------------------------------------ KV transfer
    @torch.inference_mode()
    def read_blocks(self, block_ids: list[int]) -> tuple[bytes, list[int], str]:
        """These blocks' KV (every layer's K then V) as bytes, with its shape and dtype:
        what a prefill instance sends its decode instance."""
        idx = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        kv = torch.stack([torch.stack((k.index_select(0, idx), v.index_select(0, idx)))
                          for k, v in self.kv_caches]).cpu()
        return kv.view(torch.uint8).numpy().tobytes(), list(kv.shape), str(self.dtype)

    @torch.inference_mode()
    def write_blocks(self, block_ids: list[int], data: bytes, shape: list[int],
                     dtype: str) -> None:
        """Write KV read by another instance's `read_blocks` into these blocks."""
        mine = [len(self.kv_caches), 2, len(block_ids), *self.kv_caches[0][0].shape[1:]]
        if shape != mine or dtype != str(self.dtype):
            raise ValueError(f"KV of shape {shape} ({dtype}) does not fit this instance's "
                             f"{mine} ({self.dtype}): prefill and decode must run the same "
                             f"model, dtype and block size")
        kv = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(self.dtype).view(shape)
        idx = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        for (k, v), layer in zip(self.kv_caches, kv.to(self.device)):
            k.index_copy_(0, idx, layer[0])
            v.index_copy_(0, idx, layer[1])

    def forget(self, rid: str, finished: bool = False) -> None:
        """Drop a request's state; a finished one's output may teach the proposer, a
        discarded one's (a timing run's) never does."""
        self.generators.pop(rid, None)
        q = self.seqs.pop(rid, None)
        if self.speculator is not None and q is not None:
            self.speculator.forget(rid, q.output if finished else [], finished)
        if self.matchers is not None:
            self.matchers.drop(rid)

    # ------------------------------------------------------------------ one step
    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> ModelOutput:
        spec = self.speculator
        failed: dict[str, str] = {}  # requests that cannot go on, and why
        for rid in out.finished_ids:
            self.forget(rid, finished=True)
        for new in out.new_requests:  # a retracted request comes back with its tokens
            self.seqs[new.request_id] = _Seq(new)
            if spec is not None:  # whatever it held was guessed after tokens now dropped
                spec.forget(new.request_id, [], False)
            if new.sampling_params.structured is not None:  # at the state of its tokens
                why = self._matchers().add(new.request_id, *new.sampling_params.structured,
                                           list(new.output_token_ids))
                if why is not None:
                    failed[new.request_id] = why
        if out.block_copies:
            dev = torch.device(self.device)  # staged without a sync, as the sampler's inputs
            src = on_device([s for s, _ in out.block_copies], torch.long, dev)
            dst = on_device([d for _, d in out.block_copies], torch.long, dev)
            for k, v in self.kv_caches:
                k[dst] = k[src]
                v[dst] = v[src]
            if self.draft is not None:
                self.draft.copy_blocks(src, dst)
        if not out.scheduled:
            return ModelOutput(preempted_ack=list(out.preempted_ids), failed=failed)
        constrained = self.matchers is not None and bool(self.matchers.by_id)
        guesses = self._guesses(out.scheduled, constrained) if self.max_guesses else {}
        # Grammar masks are computed on a worker thread while the forward pass runs.
        masks = self.matchers.start([(s.request_id, guesses.get(s.request_id, []))
                                     for s in out.scheduled if s.samples]) \
            if constrained else None
        parts, sample_ids = [], []
        passes = self.batches.passes(out.scheduled)
        adapters = self._adapter_slots(out.scheduled) if self.lora is not None else {}
        for entries in passes:  # a graph's logits live until its next replay: one pass only
            batch = self.batches.build(entries, self.seqs, self.graphs if len(passes) == 1
                                       and not adapters else None, guesses)
            if adapters:
                self._set_adapter_rows(batch, adapters)
            logits, hidden = self._forward(batch)
            parts.append(logits)
            sample_ids += batch.sample_ids
            if batch.prompt_spans:
                self._gather_prompt_logprobs(batch, hidden)
            if batch.pool_spans:
                self._pool(batch, hidden[len(batch.prompt_rows):])
        logits = parts[0] if len(parts) == 1 else torch.cat(parts)
        if masks is not None:
            self.matchers.apply(masks, logits, sample_ids,
                                [self.seqs[rid].stop_ids for rid in sample_ids])
        tokens, logprobs = sample(logits, self._rows(sample_ids, guesses), self.generator)
        result = ModelOutput(preempted_ack=list(out.preempted_ids), failed=failed)
        i = 0
        while i < len(sample_ids):
            rid = sample_ids[i]
            q = self.seqs[rid]
            g = guesses.get(rid)
            if g is None:
                emitted, lp = tokens[i], logprobs[i]
                q.output.append(emitted[0])  # an n>1 request's other tokens start its siblings
                i += 1
            else:  # rows i .. i + len(g): the model's samples after 0 .. len(g) guesses
                emitted = accepted_run(g, [t[0] for t in tokens[i:i + len(g) + 1]])
                lp = (None if logprobs[i] is None else
                      [row[0] for row in logprobs[i:i + len(emitted)]])
                q.output += emitted
                result.drafted[rid] = len(g)
                i += len(g) + 1
            result.sampled[rid] = emitted
            q.num_samples = 1
            if masks is not None:
                self.matchers.advance(rid, emitted[:1] if g is None else emitted)
                why = self.matchers.failure(rid)
                if why is not None:  # its tokens since the failure are not the grammar's
                    failed[rid] = why
            if lp is not None:
                result.logprobs[rid] = lp
            if q.prompt_k is not None:  # the prompt is done: they go with its first token
                result.prompt_logprobs[rid] = q.prompt_entries
                q.prompt_k, q.prompt_entries = None, []
            if q.embed is not None:  # likewise its embedding
                result.embeddings[rid] = self.pooling.finish(q.pooled, q.embed)
                q.embed, q.pooled = None, None
            if not out.propose:  # the scheduler will not guess next step
                continue
            if spec is not None:
                result.proposed[rid] = spec.propose(rid, q.prompt, q.output)
            elif self.draft is not None:  # a draft model always has guesses
                result.proposed[rid] = self.max_guesses
        return result

    def _guesses(self, scheduled: list, constrained: bool) -> dict[str, list[int]]:
        """The guesses the step's decodes of 1 + k positions verify (a draft model computes
        every known position of the step first), cut where a grammar forbids them."""
        wanted = {x.request_id: x.num_new_tokens - 1 for x in scheduled
                  if not x.is_prefill and x.num_new_tokens > 1}
        if self.draft is not None:
            guesses = self.draft.step(scheduled, self.seqs, self.batches, wanted)
        else:
            guesses = {rid: self.speculator.guesses(rid, self.seqs[rid].prompt,
                                                    self.seqs[rid].output, k)
                       for rid, k in wanted.items()}
        if constrained:
            guesses = {rid: self.matchers.cut(rid, g) for rid, g in guesses.items()}
        return guesses

    def _adapter_slots(self, scheduled: list) -> dict[str, int]:
        """Each of the step's requests that has an adapter -> the slot holding it."""
        names = {s.request_id: self.seqs[s.request_id].params.lora for s in scheduled}
        names = {rid: name for rid, name in names.items() if name is not None}
        if not names:
            return {}
        slots = self.lora.prepare(names.values())
        return {rid: slots[name] for rid, name in names.items()}

    def _set_adapter_rows(self, batch: StepBatch, adapters: dict[str, int]) -> None:
        """The pass's rows of each adapter, for the LoRA projections (or the C++ decoder)."""
        row_slots = [-1] * len(batch.ids)
        for rid, start, count in batch.spans:
            slot = adapters.get(rid)
            if slot is not None:
                row_slots[start:start + count] = [slot] * count
        self.lora.pool.batch.set(row_slots, self.lora.pool.num_slots, self.device)

    def _gather_prompt_logprobs(self, batch: StepBatch, hidden: torch.Tensor | None) -> None:
        """Each chunk's prompt logprobs, appended to its request's: row p of a chunk gives
        position p + 1's entry (the next chunk's first token is known: it is the prompt)."""
        offset = 0
        for rid, c, count in batch.prompt_spans:
            q = self.seqs[rid]
            if c == 0:
                q.prompt_entries.append(None)  # position 0 has no context to predict it
            if count:
                q.prompt_entries += target_logprobs(
                    self.model.logits, hidden[offset:offset + count],
                    q.prompt[c + 1:c + 1 + count], q.prompt_k)
                offset += count

    def _pool(self, batch: StepBatch, hidden: torch.Tensor) -> None:
        """Fold each embedding request's chunk of final hidden states into its pooling."""
        for rid, c, row, count in batch.pool_spans:
            q = self.seqs[rid]
            q.pooled = self.pooling.add(q.pooled, hidden[row:row + count], c, len(q.prompt))

    def compile_constraint(self, params: SamplingParams) -> None:
        """Compile a request's output constraint before it is scheduled, from any thread
        (the engine core's inbox compiles them off the step loop); ValueError if it
        cannot be."""
        if params.structured is not None:
            self._matchers().grammars.compile(*params.structured)

    def _matchers(self) -> Matchers:
        with self._matchers_lock:  # made on first use, by the step loop or the compiler
            if self.matchers is None:
                eos = self.arch.eos_token_ids[0] if self.arch.eos_token_ids else None
                self.matchers = Matchers(Grammars((self.folder / "tokenizer.json").read_text(),
                                                  self.arch.vocab_size, eos))
        return self.matchers

    def _forward(self, batch: StepBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits (float32) of the batch's sampling rows, and the final hidden states of its
        prompt-logprob rows (None when it has none). Those rows exist only in prefills, so
        the decode-only C++ path, which computes last-token logits alone, never needs them."""
        meta = batch.meta
        if batch.graph:  # padded to a bucket: the real rows come first
            return self.graphs.run(batch.input_ids, batch.positions, meta.slot_mapping,
                                   meta.decode_block_tables,
                                   meta.decode_lens)[:len(batch.logits_rows)], None
        lora = self.lora.pool.batch if self.lora is not None else None
        try:
            out = forward(self.model, self.decoder, batch, self.kv_caches, self._k_caches,
                          self._v_caches, self.block_size, lora=lora)
        finally:
            if lora is not None:
                lora.clear()  # the next pass (or the draft's) sets its own rows
        return out if batch.hidden_indices is not None else (out, None)

    def _rows(self, sample_ids: list[str], guesses: dict[str, list[int]]) -> list[SampleRow]:
        """One SampleRow per logits row. Row j of a verification samples after j guesses:
        penalties, min_tokens and its seed see the output with those guesses."""
        rows, j = [], 0
        for i, rid in enumerate(sample_ids):
            j = j + 1 if i and sample_ids[i - 1] == rid else 0
            q = self.seqs[rid]
            p = q.params
            # only penalties read the output's tokens: copy it with the guesses for them
            output = q.output + guesses[rid][:j] if j and needs_penalty(p) else q.output
            produced = len(q.output) + j
            gen = self._generator(rid, j, p.seed, produced) if p.seed is not None else None
            banned = q.stop_ids if produced < p.min_tokens else None
            rows.append(SampleRow(p, q.num_samples, q.prompt, output, gen, banned))
        return rows

    def _generator(self, rid: str, row: int, seed: int, position: int) -> torch.Generator:
        """A seeded request's generator for its token at output `position`, seeded from
        (seed, position): the same seed gives the same tokens in any batch, after a
        retraction, and with or without speculation (however many rows a step runs)."""
        gens = self.generators.setdefault(rid, [])
        while len(gens) <= row:
            gens.append(torch.Generator(device=self.device))
        return gens[row].manual_seed((seed * 0x9E3779B97F4A7C15 + position) % 2**64)
