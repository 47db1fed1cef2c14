"""The scheduler: who runs in the next step, with how many tokens, and whose KV is kept.

`schedule()` plans a step and `update()` applies what the executor returned; nothing else
changes request state (except `add_request`, `abort` and the KV-transfer hand-offs).
"""

from __future__ import annotations

import math

from tidal.core.budget import Admission, StepBudget
from tidal.core.config import SchedulerConfig
from tidal.core.invariants import SchedulerStats, check_invariants, collect_stats
from tidal.core.kv_cache_manager import KVCacheManager, cdiv
from tidal.core.outputs import ModelOutput, RequestOutput, ScheduledRequest, SchedulerOutput
from tidal.core.policy import make_policy
from tidal.core.ratio import NewTokenRatio
from tidal.core.request import Request, RequestStatus


class _Step:
    """Scratch state of one schedule() call."""

    __slots__ = ("out", "budget", "reserved_tokens", "preempted", "num_decodes", "num_prefills")

    def __init__(self, out: SchedulerOutput, budget: StepBudget) -> None:
        self.out = out
        self.budget = budget
        self.reserved_tokens = 0.0  # decode reservation of running + admitted this step
        self.preempted = False
        self.num_decodes = 0
        self.num_prefills = 0

    def kind(self) -> str:
        if self.num_prefills:
            return "mixed" if self.num_decodes else "prefill"
        return "decode" if self.num_decodes else "idle"


class Scheduler:
    """Continuous batching over a paged KV cache: chunked prefill under two budgets, decode
    memory reserved by a decaying ratio, retract preemption and prefix caching. The role
    (mixed, prefill, decode) is configuration of this one class."""

    def __init__(self, config: SchedulerConfig, kv: KVCacheManager) -> None:
        for name in ("chunked_prefill_size", "max_input_tokens_per_step"):
            if getattr(config, name) < kv.block_size:
                raise ValueError(f"{name}={getattr(config, name)} is under block_size="
                                 f"{kv.block_size}: no block-aligned chunk would ever fit")
        self.config = config
        self.kv = kv
        self.block_size = kv.block_size
        self.policy = make_policy(config)
        self.ratio = NewTokenRatio(config)
        self.requests: dict[str, Request] = {}  # every unfinished request
        self.waiting: list[Request] = []
        self.running: list[Request] = []  # hold blocks and compute here, admission order
        self.active_prefill: Request | None = None  # the one partially prefilled request
        self.preempted: dict[str, Request] = {}  # retracted, awaiting the executor's ack
        self.transferring: dict[str, Request] = {}  # hold blocks while their KV moves
        self.step = 0
        self.num_preemptions = 0
        self.prefix_hit_tokens = 0
        self.prefix_query_tokens = 0
        self.last_output: SchedulerOutput | None = None
        self._finished_ids: list[str] = []
        self._pending_copies: list[tuple[int, int]] = []
        self._pending_outputs: list[RequestOutput] = []  # finished inside schedule()

    # ------------------------------------------------------------------ requests in and out
    def add_request(self, request: Request) -> None:
        """Queue a request. Raises ValueError for one that can never run."""
        rid = request.request_id
        if rid in self.requests:
            raise ValueError(f"request id {rid!r} is already in use")
        if request.num_tokens >= self.config.max_model_len:
            raise ValueError(f"request {rid!r}: prompt of {request.num_tokens} tokens leaves no "
                             f"room to generate within max_model_len={self.config.max_model_len}")
        need = cdiv(request.num_tokens + 1, self.block_size)
        if need > self.kv.num_blocks:
            raise ValueError(f"request {rid!r}: prompt needs {need} KV blocks but the pool "
                             f"holds {self.kv.num_blocks}")
        request.prepare_limits(self.config.max_model_len)
        request.status = RequestStatus.WAITING
        request.enqueue_step = self.step
        request.remote_prefill = self.config.role == "decode" and not request.output_token_ids
        self.requests[rid] = request
        self.waiting.append(request)

    def abort(self, request_id: str) -> bool:
        """Cancel a request (and its n>1 siblings) from any state; frees its blocks now."""
        siblings = [r.request_id for r in self.requests.values() if r.parent_id == request_id]
        found = [self.finish_request(rid, RequestStatus.FINISHED_ABORTED, "aborted")
                 for rid in siblings + [request_id]]
        return any(found)

    def finish_request(self, request_id: str, status: RequestStatus,
                       message: str | None = None) -> bool:
        """End one request from outside (abort, a stop string found by the detokenizer)."""
        request = self.requests.get(request_id)
        if request is not None:
            self._finish(request, status, message)
        return request is not None

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def kv_sent(self, request_id: str) -> None:
        """Prefill role: the request's KV reached its decode instance; free its blocks."""
        request = self.transferring[request_id]
        self._finish(request, RequestStatus.FINISHED_TRANSFERRED, "KV sent to decode")

    def kv_received(self, request_id: str, first_token: int) -> RequestOutput:
        """Decode role: the prompt's KV and first token arrived; start decoding (or finish,
        if that token already ends the request)."""
        request = self.transferring.pop(request_id)
        request.remote_prefill = False
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        return self._append(request, first_token)

    # ------------------------------------------------------------------ planning a step
    def schedule(self) -> SchedulerOutput:
        """Plan the next step."""
        self.step += 1
        if not (self.running or self.waiting or self.preempted or self.transferring):
            self.ratio.reset()
        out = SchedulerOutput(step=self.step, kind="idle", finished_ids=self._finished_ids,
                              block_copies=self._pending_copies)
        self._finished_ids, self._pending_copies = [], []
        decoding = [r for r in self.running if r.num_computed_tokens >= r.prefill_target]
        if self.config.role == "prefill":
            budget_tokens = self.config.max_input_tokens_per_step
            step = _Step(out, StepBudget(budget_tokens, budget_tokens, self.block_size))
        else:
            step = _Step(out, StepBudget(self.config.chunked_prefill_size,
                                         self.config.max_input_tokens_per_step - len(decoding),
                                         self.block_size))
        if self.config.batch_mode == "mixed" and self.policy.decode_while_prefilling:
            # Decodes take their blocks first; a step that had to retract admits no one.
            self._schedule_decodes(step, decoding)
            if not step.preempted:
                self._schedule_prefills(step, decoding)
        else:
            self._schedule_prefills(step, decoding)
            # prefill_first holds decodes only while its chunked prefill is moving; a stalled
            # one (no memory) must not stall the decodes that would free memory for it.
            if self.config.batch_mode == "separate":
                held = bool(out.scheduled)
            else:
                held = self.active_prefill is not None and step.num_prefills > 0
            if not held:
                self._schedule_decodes(step, decoding)
        out.kind = step.kind()
        if (out.kind == "decode" and not step.preempted and not self.waiting
                and self.active_prefill is None):
            self.ratio.decay()
        self.last_output = out
        return out

    def _decode_reservation(self, request: Request) -> float:
        """Tokens kept aside for a request's future output: clipped remainder x ratio."""
        remaining = request.max_tokens - len(request.output_token_ids)
        return min(remaining, self.config.clip_max_new_tokens) * self.ratio.value

    def _reservation_of_holders(self, decoding: list[Request]) -> float:
        """_decode_reservation summed over the decodes still running and the requests whose
        KV is arriving; a plain loop with the ratio factored out, as it runs every step."""
        running, clip = RequestStatus.RUNNING, self.config.clip_max_new_tokens
        total = 0
        for r in decoding:
            if r.status is running:  # one may have finished in the decode pass
                left = r.max_tokens - len(r.output_token_ids)
                total += left if left < clip else clip
        return total * self.ratio.value + sum(
            self._decode_reservation(r) for r in self.transferring.values())

    # ------------------------------------------------------------------ decode
    def _schedule_decodes(self, step: _Step, decoding: list[Request]) -> None:
        """One token for every decoding request; retract some when blocks run short."""
        if len(decoding) > self.kv.num_free:  # someone may find no block: plan with care
            decoding = self._fit_decodes(step, decoding)
        # The hot path at large batch sizes: one pass of plain attribute reads.
        scheduled = step.out.scheduled
        before = len(scheduled)  # prefill entries may precede the decodes
        tables, bs, append_slot = self.kv.tables, self.block_size, self.kv.append_slot
        for r in decoding:
            # The next position's token must be known or in flight, and the request may
            # still grow: an executor one step ahead may already hold its last token.
            generated = len(r.output_token_ids) + r.num_in_flight
            computed = r.num_computed_tokens
            if generated >= r.out_limit or computed >= len(r.prompt_token_ids) + generated:
                continue
            table = tables[r.request_id]
            if computed >= len(table) * bs and append_slot(r) is None:
                continue  # blocks held by a KV transfer: wait for it to land
            scheduled.append(ScheduledRequest(r.request_id, 1, computed, table, True))
            r.num_computed_tokens = computed + 1
            r.num_in_flight += 1
        step.num_decodes += len(scheduled) - before

    def _fit_decodes(self, step: _Step, decoding: list[Request]) -> list[Request]:
        """The decodes that can run this step, retracting others when blocks run short."""
        ready = []
        need = 0
        tables, bs = self.kv.tables, self.block_size
        for r in decoding:
            generated = len(r.output_token_ids) + r.num_in_flight
            computed = r.num_computed_tokens
            if generated < r.out_limit and computed < len(r.prompt_token_ids) + generated:
                ready.append(r)
                if computed >= len(tables[r.request_id]) * bs:
                    need += 1  # its last block is full
        if need > self.kv.num_free:
            ready = self._retract(step, decoding, ready, need)
        return ready

    def _retract(self, step: _Step, decoding: list[Request], ready: list[Request],
                 need: int) -> list[Request]:
        """Free blocks until every remaining decode can take its block.

        Unreferenced cached blocks are already counted as free (a fresh allocation evicts
        them), so eviction comes first by construction and again after each retraction.
        Victims: shortest output first, then longest prompt (or, with preemption_order
        'newest', the last admitted first). The last request is never retracted to make
        room for itself: the partially prefilled request goes instead, and if that is not
        enough the last one finishes with `length`."""
        if self.config.preemption_order == "newest":
            victims = list(decoding)  # admission order: pop() takes the newest
        else:  # pop() takes the shortest output, longest prompt
            victims = sorted(decoding, reverse=True,
                             key=lambda r: (len(r.output_token_ids), -r.num_prompt_tokens))
        ready_ids = set(map(id, ready))
        while need > self.kv.num_free and len(victims) > 1:
            victim = victims.pop()
            if id(victim) in ready_ids:
                need -= self.kv.blocks_needed(victim, 1)
                ready_ids.discard(id(victim))
            self._preempt(step, victim)
        if need > self.kv.num_free and self.active_prefill is not None:
            self._preempt(step, self.active_prefill)
        remaining = [r for r in ready if id(r) in ready_ids]
        if need > self.kv.num_free and not self.transferring:
            for r in remaining:
                self._finish(r, RequestStatus.FINISHED_LENGTH,
                             f"KV cache exhausted: this request alone needs more than the "
                             f"{self.kv.num_blocks} blocks of the pool")
                self._pending_outputs.append(self._output(r, []))
            remaining = []
        if step.preempted:
            self.ratio.after_retract(r for r in self.running if not r.is_prefilling)
        return remaining

    def _preempt(self, step: _Step, r: Request) -> None:
        self.kv.free(r)
        self.running.remove(r)
        if self.active_prefill is r:
            self.active_prefill = None
        r.num_computed_tokens = 0
        r.prefill_target = 0
        r.status = RequestStatus.PREEMPTED
        self.preempted[r.request_id] = r
        step.out.preempted_ids.append(r.request_id)
        step.preempted = True
        self.num_preemptions += 1

    # ------------------------------------------------------------------ prefill
    def _schedule_prefills(self, step: _Step, decoding: list[Request]) -> None:
        """Continue the running prefill(s), then admit waiting requests in policy order."""
        if self.config.role == "prefill":
            prefilling = [r for r in self.running if r.is_prefilling]
        else:  # at most one request is partially prefilled here
            prefilling = [self.active_prefill] if self.active_prefill else []
        if not (prefilling or self.waiting):
            return
        if self.config.role != "prefill":
            step.reserved_tokens = self._reservation_of_holders(decoding)
        for r in prefilling:
            if self._admit(step, r) is not Admission.ADMITTED:
                return
        if not self.waiting:
            return
        admitted = []
        for r in self.policy.order(self.waiting, self.step, self._prefix_tokens):
            if self._admit(step, r) is not Admission.ADMITTED:
                break  # FIFO fairness: nobody overtakes the first one that does not fit
            admitted.append(r)
        if admitted:
            taken = set(map(id, admitted))
            self.waiting = [r for r in self.waiting if id(r) not in taken]

    def _prefix_tokens(self, r: Request) -> int:
        return len(self.kv.match_prefix(r)) * self.block_size

    def _admit(self, step: _Step, r: Request) -> Admission:
        """The one admission path for fresh, retracted and partially prefilled requests:
        size the chunk under the budgets, check memory with reservations, allocate."""
        cfg = self.config
        fresh = r.status is RequestStatus.WAITING
        hit = []
        if fresh:
            if len(self.running) + len(self.transferring) >= cfg.max_num_seqs:
                return Admission.BUDGET_EXHAUSTED
            hit = self.kv.match_prefix(r)
        computed = len(hit) * self.block_size if fresh else r.num_computed_tokens
        target = r.num_tokens if fresh else r.prefill_target
        remaining = target - computed
        if r.remote_prefill:
            num_new = remaining  # computed elsewhere: takes blocks, not tokens
        else:
            num_new = step.budget.chunk_size(computed, remaining)
            if num_new <= 0:
                return Admission.BUDGET_EXHAUSTED
        chunked = num_new < remaining
        if chunked and cfg.role != "prefill" and self.active_prefill not in (None, r):
            return Admission.BUDGET_EXHAUSTED  # one chunked prefill at a time
        # The prefill role takes the whole prompt's blocks up front: it never retracts.
        alloc = remaining if cfg.role == "prefill" else num_new
        # Reservations and the margin protect others; a request alone may use the whole pool
        # (otherwise one whose output estimate exceeds the pool would wait forever).
        others = self._others_hold_blocks(r)
        own = 0.0
        if not chunked and cfg.role != "prefill" and others:
            own = self._decode_reservation(r)
        need = self.kv.blocks_needed(r, alloc, hit)
        need += cdiv(math.ceil(step.reserved_tokens + own), self.block_size)
        if fresh and others:
            need += int(cfg.safety_margin * self.kv.num_blocks)
        if need > self.kv.num_free:
            return Admission.NO_MEMORY
        if not self.kv.allocate(r, alloc, hit):
            return Admission.NO_MEMORY
        step.reserved_tokens += own
        if fresh:
            self._start(r, computed)
        if r.remote_prefill:
            r.num_computed_tokens = target  # the KV is being written by the prefill side
            step.out.transfer_ids.append(r.request_id)
            return Admission.ADMITTED
        # Only a newly chunked request spends the chunk allowance: the continuing chunk must
        # not starve short requests that fit whole (it still spends rem_input_tokens).
        step.budget.spend(num_new, chunked and fresh)
        step.num_prefills += 1
        if chunked and cfg.role != "prefill":
            self.active_prefill = r
        elif self.active_prefill is r:
            self.active_prefill = None
        samples = computed + num_new == r.num_tokens
        step.out.scheduled.append(ScheduledRequest(
            r.request_id, num_new, computed, self.kv.block_ids(r.request_id), samples))
        r.num_computed_tokens = computed + num_new
        r.num_in_flight += samples
        return Admission.ADMITTED

    def _others_hold_blocks(self, r: Request) -> bool:
        return bool(self.transferring) or any(x is not r for x in self.running)

    def _start(self, r: Request, num_cached: int) -> None:
        r.num_computed_tokens = num_cached
        r.num_cached_tokens = num_cached
        r.prefill_target = r.num_tokens
        self.prefix_hit_tokens += num_cached
        self.prefix_query_tokens += r.num_tokens
        if r.remote_prefill:  # decode role: holds blocks while its KV arrives
            r.status = RequestStatus.TRANSFERRING
            self.transferring[r.request_id] = r
        else:
            r.status = RequestStatus.RUNNING
            self.running.append(r)

    # ------------------------------------------------------------------ applying results
    def update(self, out: SchedulerOutput, result: ModelOutput) -> list[RequestOutput]:
        """Apply one step's results: acknowledge preemptions, append sampled tokens, check
        stop conditions, fork n>1 requests, cache computed blocks. Returns what changed."""
        acks = result.preempted_ack if self.config.async_scheduling else out.preempted_ids
        for rid in acks:
            self._on_preempt_ack(rid)
        outputs, self._pending_outputs = self._pending_outputs, []
        requests, sampled, bs = self.requests, result.sampled, self.block_size
        running = RequestStatus.RUNNING
        plain = self.config.role != "prefill"  # the prefill role hands off every first token
        for x in out.scheduled:
            rid = x.request_id
            r = requests.get(rid)
            if r is None:
                continue  # finished or aborted meanwhile: its token is dropped
            samples = x.samples
            if samples:
                r.num_in_flight -= 1
            if r.status is not running:
                continue  # preempted while in flight: dropped, recomputed on re-admission
            num_new, computed = x.num_new_tokens, x.num_computed_tokens
            if num_new > 1 or (computed + 1) % bs == 0:  # a block may have filled up
                self.kv.cache_computed(r, computed + num_new)
            if not samples:
                continue
            tokens = sampled.get(rid)
            if not tokens:
                self._finish(r, RequestStatus.FINISHED_ERROR, "the executor returned no token")
                outputs.append(self._output(r, []))
                continue
            if r.fork_pending:
                outputs.extend(self._fork(r, tokens[1:]))
            token = tokens[0]
            generated = r.output_token_ids
            if plain and token not in r.stop_ids and len(generated) + 1 < r.out_limit:
                generated.append(token)  # _append's common case, inlined for the hot path
                outputs.append(RequestOutput(rid, [token], False, None, None, r.parent_id))
            else:
                outputs.append(self._append(r, token))
        return outputs

    def _on_preempt_ack(self, rid: str) -> None:
        r = self.preempted.pop(rid, None)
        if r is None:
            return  # aborted meanwhile
        r.status = RequestStatus.WAITING
        r.enqueue_step = self.step
        self.waiting.append(r)  # the tail: FIFO, keeping its generated tokens

    @staticmethod
    def _stop_status(r: Request, token: int) -> RequestStatus | None:
        if token in r.stop_ids:  # EOS (unless ignore_eos) and stop_token_ids
            return RequestStatus.FINISHED_STOPPED
        if len(r.output_token_ids) >= r.out_limit:  # max_tokens or max_model_len
            return RequestStatus.FINISHED_LENGTH
        return None

    def _append(self, r: Request, token: int) -> RequestOutput:
        r.output_token_ids.append(token)
        status = self._stop_status(r, token)
        if status is None and self.config.role != "prefill":  # the common case, kept cheap
            return RequestOutput(r.request_id, [token], parent_id=r.parent_id)
        if status is not None:
            self._finish(r, status)
        elif self.config.role == "prefill":
            self._leave_for_transfer(r)
            return RequestOutput(r.request_id, [token], parent_id=r.parent_id, kv_transfer=True)
        return self._output(r, [token])

    def _output(self, r: Request, tokens: list[int]) -> RequestOutput:
        return RequestOutput(r.request_id, tokens, r.is_finished, r.finish_reason,
                             r.finish_message, r.parent_id)

    def _leave_for_transfer(self, r: Request) -> None:
        self.running.remove(r)
        r.status = RequestStatus.TRANSFERRING
        self.transferring[r.request_id] = r

    def _fork(self, parent: Request, tokens: list[int]) -> list[RequestOutput]:
        """n>1: siblings share the prompt's full blocks and copy its partial last block.
        A sibling that finds no free block recomputes its prompt from the waiting queue."""
        parent.fork_pending = False
        outputs = []
        for index, token in enumerate(tokens, start=1):
            child = parent.fork(index, token)
            self.requests[child.request_id] = child
            copies = self.kv.fork(parent, child, parent.prefill_target)
            if copies is None:
                child.enqueue_step = self.step
                self.waiting.append(child)
                status = self._stop_status(child, token)
                if status is not None:
                    self._finish(child, status)
                outputs.append(self._output(child, [token]))
                continue
            self._pending_copies.extend(copies)
            child.num_computed_tokens = child.prefill_target = parent.prefill_target
            child.status = RequestStatus.RUNNING
            self.running.append(child)
            child.output_token_ids.pop()  # _append puts it back and checks stop conditions
            outputs.append(self._append(child, token))
        return outputs

    def _finish(self, r: Request, status: RequestStatus, message: str | None = None) -> None:
        prior = r.status
        r.status = status
        r.finish_message = message
        if prior is RequestStatus.WAITING:
            self.waiting.remove(r)
        elif prior is RequestStatus.RUNNING:
            self.running.remove(r)
        elif prior is RequestStatus.PREEMPTED:
            del self.preempted[r.request_id]
        elif prior is RequestStatus.TRANSFERRING:
            del self.transferring[r.request_id]
        if self.active_prefill is r:
            self.active_prefill = None
        self.kv.free(r)
        del self.requests[r.request_id]
        self._finished_ids.append(r.request_id)

    # ------------------------------------------------------------------ observability
    def stats(self) -> SchedulerStats:
        return collect_stats(self)

    def check_invariants(self) -> None:
        """Raise InvariantError if blocks leak or double-own, or a step broke its budgets."""
        check_invariants(self)
