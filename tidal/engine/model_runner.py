"""Executes a SchedulerOutput on a worker's model: builds the flattened batch, runs the
forward pass over the paged KV cache, samples, verifies guesses, and returns a ModelOutput.
The worker (`worker.py`) loads what it runs on."""

from __future__ import annotations

import logging
import threading
from collections import deque
from pathlib import Path
from typing import Callable

import torch

from tidal.core import ModelOutput, NewRequest, PromptLogprob, SamplingParams, SchedulerOutput
from tidal.core.kv_cache_manager import cdiv
from tidal.core.request import token_slice
from tidal.engine.batch import BatchBuilder, StepBatch, forward
from tidal.engine.decode_graphs import CaptureBackend, DecodeGraphs
from tidal.engine.kv_cache import KVCache
from tidal.engine.lora_manager import LoRAManager
from tidal.engine.prompt_outputs import PromptOutputs
from tidal.engine.step_inputs import StepInputs
from tidal.engine.structured import Grammars, Matchers
from tidal.model import cpu_extension
from tidal.model.attention import AttentionBackend
from tidal.model.config import ModelArch
from tidal.model.llama import StepCut
from tidal.model.logits_processors import load_processors
from tidal.model.pipeline_parallel import Pending
from tidal.model.pooling import Pooling
from tidal.model.sampler import SampleRow, needs_penalty, sample
from tidal.spec import Guesser
from tidal.spec.tree import GuessTree

log = logging.getLogger("tidal.engine")


class _Launch:
    """A step between `launch` and `complete`: its plan, failures found so far, guesses,
    grammar masks in the making, each pass's batch and forward result, and requests that
    finished meanwhile (forgotten once it completes)."""

    __slots__ = ("out", "failed", "guesses", "masks", "passes", "finished")

    def __init__(self, out: SchedulerOutput) -> None:
        self.out = out
        self.failed: dict[str, str] = {}  # requests that cannot go on, and why
        self.guesses: dict[str, GuessTree] = {}
        self.masks = None
        self.passes: list[tuple[StepBatch, object]] = []
        self.finished: list[str] = []


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
    """Runs steps on a worker's model and KV cache: turns each SchedulerOutput into forward
    passes, samples, verifies guesses and returns a ModelOutput. It reads only the plain data
    of the plan: a request's prompt and parameters come with its first scheduled step, and
    the runner keeps the tokens it samples (and each request's generators)."""

    def __init__(self, model, decoder, kv: KVCache, backend: AttentionBackend,
                 tokenizer_folder: Path, arch: ModelArch, seed: int, max_forward_tokens: int,
                 guesser: Guesser | None = None, lora: LoRAManager | None = None,
                 pooling: Pooling | None = None, logits_processors: tuple = (),
                 logprobs_mode: str = "adjusted_logprobs") -> None:
        self.model, self.decoder, self.kv, self.arch = model, decoder, kv, arch
        self.device, self.block_size = kv.device, kv.block_size
        self.tokenizer_folder = tokenizer_folder  # structured outputs read its tokenizer.json
        self.guesser, self.lora = guesser, lora
        self.max_guesses = guesser.max_guesses if guesser is not None else 0
        # a tree's rows sit at slots past their positions, which a sliding window (counted
        # in slots) would misplace: such models verify the main path alone
        self.trees = not any(getattr(layer.self_attn, "window", 0)
                             for layer in getattr(model, "layers", ()))
        self.prompt_outputs = PromptOutputs(model, pooling or Pooling())
        # custom logits processors (logits_processors.py), made here by name
        self.processors = [cls(arch.vocab_size, torch.device(self.device))
                           for cls in load_processors(logits_processors)]
        self.logprobs_mode = logprobs_mode  # requests without their own
        self.matchers: Matchers | None = None  # structured outputs, made on first use
        self._matchers_lock = threading.Lock()
        # Sampling draws its noise on the logits' device, so the generators live there.
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self.generators: dict[str, list[torch.Generator]] = {}  # seeded: one per row
        self.seqs: dict[str, _Seq] = {}
        self.batches = BatchBuilder(kv.block_size, kv.null_block, self.device, backend,
                                    StepInputs(self.device), max_forward_tokens)
        self.graphs: DecodeGraphs | None = None
        self.launched: deque[_Launch] = deque()  # steps started, not yet completed
        # whether a live request waits (the engine core's, where it may cut steps short)
        self.cut_check: Callable[[], bool] | None = None

    @property
    def kv_caches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return self.kv.layers

    @property
    def null_block(self) -> int:
        return self.kv.null_block

    @property
    def num_blocks(self) -> int:
        return self.kv.num_blocks

    @torch.inference_mode()
    def use_decode_graphs(self, backend: CaptureBackend, max_num_seqs: int,
                          max_model_len: int) -> None:
        """Capture decode steps of every batch-size bucket up to max_num_seqs; a capture
        that fails (a kernel that does not compile here) leaves every step eager."""
        graphs = DecodeGraphs(self.model, self.kv.layers, max_num_seqs,
                              cdiv(max_model_len, self.block_size), self.kv.null_block,
                              self.block_size, self.device)
        try:
            graphs.capture(backend)
        except Exception as exc:
            if not self.device.startswith("cuda"):
                raise
            log.warning("decode graph capture failed (%s); decoding eagerly", exc)
            return
        self.graphs = graphs

    def forget(self, rid: str, finished: bool = False) -> None:
        """Drop a request's state; a finished one's output may teach the proposer, a
        discarded one's (a timing run's) never does."""
        self.generators.pop(rid, None)
        q = self.seqs.pop(rid, None)
        if self.guesser is not None and q is not None:
            self.guesser.forget(rid, q.output if finished else [], finished)
        if self.matchers is not None:
            self.matchers.drop(rid)

    # ------------------------------------------------------------------ one step
    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> ModelOutput:
        try:
            launch = self.launch(out)
        except StepCut:  # nothing sampled: the scheduler undoes the plan
            return ModelOutput(preempted_ack=list(out.preempted_ids), cut=True)
        return self.complete(launch)

    @torch.inference_mode()
    def launch(self, out: SchedulerOutput) -> "_Launch":
        """Start a step: its requests in, its guesses and grammar masks begun, its forward
        passes run (a pipeline stage before the last leaves their ends `Pending`); its
        output is `complete`'s, steps completing in the order they started."""
        guesser = self.guesser
        launch = _Launch(out)
        busy = {s.request_id for earlier in self.launched for s in earlier.out.scheduled
                } if self.launched and out.finished_ids else ()
        for rid in out.finished_ids:  # one still in an earlier step goes when that one does
            if rid in busy:
                self.launched[-1].finished.append(rid)
            else:
                self.forget(rid, finished=True)
        for new in out.new_requests:  # a retracted request comes back with its tokens
            self.seqs[new.request_id] = _Seq(new)
            if guesser is not None:  # whatever it held was guessed after tokens now dropped
                guesser.forget(new.request_id, [], False)
            if new.sampling_params.structured is not None:  # at the state of its tokens
                why = self._matchers().add(new.request_id, *new.sampling_params.structured,
                                           list(new.output_token_ids))
                if why is not None:
                    launch.failed[new.request_id] = why
        self.launched.append(launch)
        if out.scheduled:
            try:
                self._run(launch)
            except BaseException:
                self.launched.remove(launch)  # the step failed: it never completes
                raise
        return launch

    def _run(self, launch: "_Launch") -> None:
        out = launch.out
        constrained = self.matchers is not None and bool(self.matchers.by_id)
        guesses = self._guesses(out.scheduled, constrained) if self.max_guesses else {}
        # Grammar masks are computed on a worker thread while the forward pass runs.
        launch.masks = self.matchers.start([(s.request_id, guesses[s.request_id].tokens
                                             if s.request_id in guesses else [])
                                            for s in out.scheduled if s.samples]) \
            if constrained else None
        launch.guesses = guesses
        passes = self.batches.passes(out.scheduled)
        adapters = self._adapter_slots(out.scheduled) if self.lora is not None else {}
        plain = out.cuttable and not (constrained or guesses or adapters)
        self.model.between_layers = self.cut_check if plain else None
        try:
            for entries in passes:  # a graph's logits live until its next replay: one pass
                batch = self.batches.build(entries, self.seqs, self.graphs if len(passes) == 1
                                           and not adapters else None, guesses)
                if adapters:
                    self._set_adapter_rows(batch, adapters)
                launch.passes.append((batch, self._forward(batch)))
        finally:
            self.model.between_layers = None

    @torch.inference_mode()
    def complete(self, launch: "_Launch") -> ModelOutput:
        """The output of the oldest step launched (`launch`): its passes' logits, then the
        tokens sampled, guesses verified and prompt outputs gathered."""
        if not self.launched or self.launched[0] is not launch:
            raise RuntimeError("steps complete in the order they were launched")
        self.launched.popleft()
        try:
            return self._complete(launch)
        finally:
            for rid in launch.finished:
                self.forget(rid, finished=True)

    def _complete(self, launch: "_Launch") -> ModelOutput:
        out, failed, guesses, masks = launch.out, launch.failed, launch.guesses, launch.masks
        guesser = self.guesser
        if not out.scheduled:
            return ModelOutput(preempted_ack=list(out.preempted_ids), failed=failed)
        parts, sample_ids = [], []
        for batch, ran in launch.passes:
            logits, hidden = ran.result() if isinstance(ran, Pending) else ran
            parts.append(logits)
            sample_ids += batch.sample_ids
            self.prompt_outputs.gather(batch, hidden, self.seqs)
        logits = parts[0] if len(parts) == 1 else torch.cat(parts)
        if masks is not None:
            self.matchers.apply(masks, logits, sample_ids,
                                [self.seqs[rid].stop_ids for rid in sample_ids])
        tokens, logprobs = sample(logits, self._rows(sample_ids, guesses), self.generator,
                                  self.processors, self.logprobs_mode)
        result = ModelOutput(preempted_ack=list(out.preempted_ids), failed=failed)
        moves: tuple[list[int], list[int]] = ([], [])  # KV slots of accepted branches
        entries = {s.request_id: s for s in out.scheduled} if guesses else {}
        i = 0
        while i < len(sample_ids):
            rid = sample_ids[i]
            q = self.seqs[rid]
            g = guesses.get(rid)
            if g is None:
                emitted, lp = tokens[i], logprobs[i]
                q.output.append(emitted[0])  # an n>1 request's other tokens start its siblings
                i += 1
            else:  # rows i .. i + len(g): the model's samples after the root and each node
                emitted, nodes = g.accept([t[0] for t in tokens[i:i + len(g) + 1]])
                rows = [i] + [i + 1 + n for n in nodes]
                lp = None if logprobs[i] is None else [logprobs[r][0] for r in rows]
                self._settle(entries[rid], nodes, moves)
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
            self.prompt_outputs.hand_over(rid, q, result)  # the prompt is done
            if out.propose and guesser is not None:  # the scheduler may guess next step
                result.proposed[rid] = guesser.propose(rid, q.prompt, q.output,
                                                       q.params.prediction)
        if moves[0]:
            self.kv.move_slots(*moves)
        return result

    def _settle(self, entry, nodes: list[int], moves: tuple[list[int], list[int]]) -> None:
        """Accepted tree nodes' KV to the slots of their positions: node n at depth j sits at
        slot c + 1 + n and belongs at c + j (a chain's nodes are there already)."""
        c, table, bs = entry.num_computed_tokens, entry.block_ids, self.block_size
        for depth, node in enumerate(nodes, start=1):
            if node + 1 != depth:
                src, dst = c + 1 + node, c + depth
                moves[0].append(table[src // bs] * bs + src % bs)
                moves[1].append(table[dst // bs] * bs + dst % bs)

    def _guesses(self, scheduled: list, constrained: bool) -> dict[str, GuessTree]:
        """The guesses the step's decodes of 1 + k positions verify (a draft model computes
        every known position of the step first): a proposer's tree, or a draft's path. A
        grammar is checked along one path: a constrained request (and a model with sliding
        windows) verifies the main path alone, cut where the grammar forbids it."""
        wanted = {x.request_id: x.num_new_tokens - 1 for x in scheduled
                  if not x.is_prefill and x.num_new_tokens > 1}
        guesses = {rid: g if isinstance(g, GuessTree) else GuessTree.chain(g)
                   for rid, g in self.guesser.guesses(scheduled, self.seqs, self.batches,
                                                      wanted).items()}
        if constrained or not self.trees:
            guesses = {rid: g if g.is_chain() else GuessTree.chain(g.main_path())
                       for rid, g in guesses.items()}
        if constrained:
            guesses = {rid: GuessTree.chain(self.matchers.cut(rid, g.tokens))
                       for rid, g in guesses.items()}
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
                ext = cpu_extension.loaded()  # (a CPU runner loads it at start)
                vocab = (self.tokenizer_folder / "tokenizer.json").read_text()
                self.matchers = Matchers(Grammars(vocab, self.arch.vocab_size, eos),
                                         ext.apply_token_bitmask if ext is not None else None)
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
            out = forward(self.model, self.decoder, batch, self.kv.layers, self.kv.k_caches,
                          self.kv.v_caches, self.block_size, lora=lora)
        finally:
            if lora is not None:
                lora.clear()  # the next pass (or the draft's) sets its own rows
        if isinstance(out, Pending):  # a pipeline stage's end, taken at completion
            return out if batch.hidden_indices is not None else Pending(
                lambda: (out.result(), None))
        return out if batch.hidden_indices is not None else (out, None)

    def _rows(self, sample_ids: list[str], guesses: dict[str, GuessTree]) -> list[SampleRow]:
        """One SampleRow per logits row. Row j > 0 of a verification samples after node
        j - 1 of its guesses: penalties, min_tokens and its seed see the output with the
        guesses on that node's path."""
        rows, j, depths = [], 0, {}
        for i, rid in enumerate(sample_ids):
            j = j + 1 if i and sample_ids[i - 1] == rid else 0
            q = self.seqs[rid]
            p = q.params
            if j and rid not in depths:  # a verification's first guess row
                depths[rid] = guesses[rid].depths()
            depth = depths[rid][j - 1] if j else 0
            # only penalties, bad words and custom processors read the output's tokens:
            # copy it with the guesses for them
            reads = needs_penalty(p) or p.bad_words_token_ids or self.processors
            output = q.output + guesses[rid].path_tokens(j - 1) if depth and reads else q.output
            produced = len(q.output) + depth
            # a fork's sample i is sibling i's first token: seeded as the sibling (seed + i)
            gen = None if p.seed is None else [self._generator(rid, j + i, p.seed + i, produced)
                                               for i in range(q.num_samples)]
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
