"""The scheduler: who runs in the next step, with how many tokens, and whose KV is kept.

`schedule()` plans a step and `update()` applies what the executor returned; nothing else
changes request state (except `add_request`, `abort` and the KV-transfer hand-offs).
"""

from __future__ import annotations

import math
import time
from itertools import chain
from typing import Callable, Iterable

from tidal.core.budget import Admission, StepPlan
from tidal.core.config import SchedulerConfig
from tidal.core.forks import fork_siblings
from tidal.core.invariants import SchedulerStats, check_invariants, collect_stats
from tidal.core.kv_cache_manager import KVCacheManager, cdiv
from tidal.core.kv_tiers import (admit_load, load_inline, loads_done, loads_inline,
                                  prefetch, tier_run)
from tidal.core.lora import AdapterSlots
from tidal.core.outputs import (ModelOutput, RequestOutput, ScheduledRequest, SchedulerOutput,
                                new_request)
from tidal.core.policies import make_policy
from tidal.core.policies.base import foreground_first
from tidal.core.ratio import NewTokenRatio
from tidal.core.request import Request, RequestStatus, ready_to_decode
from tidal.core.roles import ROLES
from tidal.core.speculation import Speculation, guess_budget
from tidal.core.step_cut import cuttable, undo_step
from tidal.core.step_sizing import StepTarget
from tidal.core.step_time import StepTimeModel


class Scheduler:
    """Continuous batching over a paged KV cache: chunked prefill under two budgets, decode
    memory reserved by a decaying ratio, retract preemption and prefix caching. The role
    (mixed, prefill, decode) is configuration of this one class.

    `step_time` predicts a step's seconds from its shape and `clock` reads the time
    requests' `arrival_time` is on (the simulator's virtual clock); every policy sizes
    steps by `step_time` under `step_target` (default: `max_step_ms`), and the `slo` policy
    plans with both. Adaptive speculation prices guesses with `guess_time` (or `step_time`)."""

    def __init__(self, config: SchedulerConfig, kv: KVCacheManager,
                 step_time: StepTimeModel | None = None,
                 clock: Callable[[], float] = time.time,
                 guess_time: StepTimeModel | None = None,
                 step_target: StepTarget | None = None) -> None:
        for name in ("chunked_prefill_size", "max_input_tokens_per_step"):
            if getattr(config, name) < kv.block_size:
                raise ValueError(f"{name}={getattr(config, name)} is under block_size="
                                 f"{kv.block_size}: no block-aligned chunk would ever fit")
        self.config, self.kv, self.block_size = config, kv, kv.block_size
        self.role, self.policy = ROLES[config.role], make_policy(config)
        for needs, what in ((self.policy.needs_step_time, f"policy {config.policy!r}"),
                            (config.max_step_ms, "max_step_ms")):
            if needs and step_time is None:
                raise ValueError(f"{what} needs a step-time model")
        self.step_time, self.clock = step_time, clock
        self.target = step_target or StepTarget.of_ms(config.max_step_ms)
        self.ratio = NewTokenRatio(config)
        self.spec = Speculation(config, guess_time or step_time, self.policy.tpot, self.target)
        self.loras = AdapterSlots(config.max_loras, config.lora_wait_steps)
        self.requests: dict[str, Request] = {}  # every unfinished request
        self.waiting: list[Request] = []
        self.running: list[Request] = []  # hold blocks and compute here, admission order
        self.active_prefill: Request | None = None  # the one partially prefilled request
        self.preempted: dict[str, Request] = {}  # retracted, awaiting the executor's ack
        self.transferring: dict[str, Request] = {}  # hold blocks while their KV moves
        self.step = self.num_preemptions = self.num_steps_cut = 0
        self.prefix_hit_tokens = self.prefix_query_tokens = 0  # prompt tokens: hit, looked up
        self.last_output: SchedulerOutput | None = None
        self._finished_ids: list[str] = []
        self._pending_copies: list[tuple[int, int]] = []
        self._pending_outputs: list[RequestOutput] = []  # finished inside schedule()
        self._pending_new: list[Request] = []  # running without a prefill step: announce

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
        request.remote_prefill = self.role.kv_arrives(request)
        self.loras.note(request)
        self.requests[rid] = request
        self.waiting.append(request)

    def abort(self, request_id: str) -> bool:
        """Cancel a request (and its n>1 siblings) from any state; frees its blocks now."""
        siblings = [r.request_id for r in self.requests.values() if r.parent_id == request_id]
        return any([self.finish_request(rid, RequestStatus.FINISHED_ABORTED, "aborted")
                    for rid in siblings + [request_id]])

    def finish_request(self, request_id: str, status: RequestStatus,
                       message: str | None = None) -> bool:
        """End one request from outside (abort, a stop string found by the detokenizer)."""
        request = self.requests.get(request_id)
        if request is not None:
            self._finish(request, status, message)
        return request is not None

    def reject(self, request: Request, message: str) -> None:
        """End a waiting request unrun (a policy's overload decision), output next update."""
        self._end_now(request, RequestStatus.FINISHED_REJECTED, message)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def prefill_backlog(self, waiting: Iterable[Request]) -> int:
        """Prompt tokens still to compute here before anyone behind them: the rest of the
        running prefills and the whole prompts of `waiting` (whose KV is not sent here)."""
        return (sum(r.prefill_target - r.num_computed_tokens for r in self.running
                    if r.is_prefilling)
                + sum(r.num_tokens for r in waiting if not r.remote_prefill))

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
        self._pending_new.append(request)  # its first step here is a decode
        return self._append(request, first_token)

    # ------------------------------------------------------------------ planning a step
    def schedule(self) -> SchedulerOutput:
        """Plan the next step: the policy decides what it holds."""
        self.step += 1
        if not (self.running or self.waiting or self.preempted or self.transferring):
            self.ratio.reset()
        out = SchedulerOutput(step=self.step, kind="idle", finished_ids=self._finished_ids,
                              block_copies=self._pending_copies,
                              propose=bool(self.spec.planner.max_guesses),
                              kv_stores=self.kv.tiers.take_stores() if self.kv.tiers else [])
        self._finished_ids, self._pending_copies = [], []
        if self._pending_new:
            out.new_requests = [new_request(r) for r in self._pending_new
                                if self.requests.get(r.request_id) is r]
            self._pending_new = []
        decoding = self.role.decoding(self.running)
        plan = StepPlan(out, self.role.step_budget(self.config, len(decoding), self.block_size),
                        self.config.max_num_seqs)
        if self.waiting or self.active_prefill is not None or self.role.concurrent_prefills:
            self.policy.size_step(self, plan, decoding)
        self.policy.compose(self, plan, decoding)
        if self.kv.tiers is not None:
            prefetch(self, plan)  # the head of the queue loads while it waits
        out.kind = plan.kind()
        out.cuttable = cuttable(self, out)
        if (out.kind == "decode" and not plan.preempted and not self.waiting
                and self.active_prefill is None):
            self.ratio.decay()
        self.last_output = out
        return out

    # ------------------------------------------------------------------ decode
    def schedule_decodes(self, plan: StepPlan, decoding: list[Request]) -> None:
        """One token for every decoding request that can take one; retract some when
        blocks run short."""
        ready = ready_to_decode(decoding, self.config.steps_in_flight)
        if len(ready) > self.kv.num_free:  # someone may find no block: count with care
            ready = self._fit_decodes(plan, decoding, ready)
        # The hot path at large batch sizes: one pass of plain attribute reads.
        scheduled = plan.out.scheduled
        before = len(scheduled)  # prefill entries may precede the decodes
        tables, bs, append_slot = self.kv.tables, self.block_size, self.kv.append_slot
        for r in ready:
            computed = r.num_computed_tokens
            table = tables[r.request_id]
            if computed >= len(table) * bs and append_slot(r) is None:
                continue  # blocks held by a KV transfer: wait for it to land
            scheduled.append(ScheduledRequest(r.request_id, 1, computed, table, True, False))
            r.num_computed_tokens = computed + 1
            r.num_in_flight += 1
        plan.num_decodes += len(scheduled) - before
        if self.spec.planner.max_guesses and len(scheduled) > before:
            prompts = chain([self.active_prefill] if self.active_prefill else (), self.waiting)
            self.spec.add_guesses(self.kv, self.requests, plan, scheduled[before:],
                                  guess_budget(plan, prompts, self.role.kv_arrives))

    def _fit_decodes(self, plan: StepPlan, decoding: list[Request],
                     ready: list[Request]) -> list[Request]:
        """The ready decodes that can run this step, retracting others when blocks are
        short (a decode needs a block only when its last one is full)."""
        need = sum(self.kv.blocks_needed(r, 1) for r in ready)
        return self._retract(plan, decoding, ready, need) if need > self.kv.num_free else ready

    def _retract(self, plan: StepPlan, decoding: list[Request], ready: list[Request],
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
            self.retract(plan, victim)
        if need > self.kv.num_free and self.active_prefill is not None:
            self.retract(plan, self.active_prefill)
        remaining = [r for r in ready if id(r) in ready_ids]
        if need > self.kv.num_free and not self.transferring:
            for r in remaining:
                self._end_now(r, RequestStatus.FINISHED_LENGTH,
                              f"KV cache exhausted: this request alone needs more than the "
                              f"{self.kv.num_blocks} blocks of the pool")
            remaining = []
        if plan.preempted:
            self.ratio.after_retract(r for r in self.running if not r.is_prefilling)
        return remaining

    def retract(self, plan: StepPlan, r: Request) -> None:
        """Free a running request's blocks; it rejoins the queue once the executor acks."""
        self.kv.free(r)
        self.running.remove(r)
        if self.active_prefill is r:
            self.active_prefill = None
        r.num_computed_tokens = 0
        r.num_guesses = 0
        r.prefill_target = 0
        r.status = RequestStatus.PREEMPTED
        self.preempted[r.request_id] = r
        plan.out.preempted_ids.append(r.request_id)
        plan.preempted = True
        self.num_preemptions += 1

    # ------------------------------------------------------------------ prefill
    def schedule_prefills(self, plan: StepPlan, decoding: list[Request]) -> None:
        """Continue the running prefill(s), then admit waiting requests in policy order."""
        if self.role.concurrent_prefills:
            prefilling = [r for r in self.running if r.is_prefilling]
        else:  # at most one request is partially prefilled here
            prefilling = [self.active_prefill] if self.active_prefill else []
        if not (prefilling or self.waiting):
            return
        if self.role.reserves_output:  # decodes still running and KV on its way
            running = RequestStatus.RUNNING  # one may have finished in the decode pass
            plan.reserved_tokens = self.ratio.reserved_tokens(chain(
                [r for r in decoding if r.status is running], self.transferring.values()))
        for r in prefilling:
            if self._admit(plan, r) is not Admission.ADMITTED:
                return
        if not self.waiting:
            return
        plan.adapters = self.loras.adapters_of(chain(self.running, self.transferring.values()))
        admitted = []
        for r in foreground_first(self.policy.order(self.waiting, self.step,
                                                    self._prefix_tokens), plan.live_only):
            result = self._admit(plan, r)
            if result is Admission.ADMITTED:
                admitted.append(r)
            elif not (result is Admission.NO_ADAPTER_SLOT
                      and self.loras.may_be_passed(r, self.step)):
                break  # FIFO fairness: nobody overtakes the first one that does not fit
        if admitted:
            taken = set(map(id, admitted))
            self.waiting = [r for r in self.waiting if id(r) not in taken]

    def _prefix_tokens(self, r: Request) -> int:
        return len(self.kv.match_prefix(r)) * self.block_size

    def _admit(self, plan: StepPlan, r: Request) -> Admission:
        """The one admission path for fresh, retracted and partially prefilled requests:
        size the chunk under the budgets, reserve its blocks, commit it to the plan."""
        fresh = r.status is RequestStatus.WAITING
        if fresh and len(self.running) + len(self.transferring) >= plan.max_seqs:
            return Admission.BUDGET_EXHAUSTED
        if fresh and not self.loras.claim(plan.adapters, r):
            return Admission.NO_ADAPTER_SLOT  # (a claim that fails below ends the loop)
        hit = self.kv.match_prefix(r) if fresh else []
        keys = tier_run(self, r, hit) if fresh and self.kv.tiers else []
        inline = bool(keys) and loads_inline(self, r)  # its tier blocks count as computed
        computed = ((len(hit) + len(keys) * inline) * self.block_size if fresh
                    else r.num_computed_tokens)
        remaining = (r.num_tokens if fresh else r.prefill_target) - computed
        num_new = self._chunk_size(plan, r, computed, remaining)
        if num_new == 0:
            return Admission.BUDGET_EXHAUSTED
        chunked = num_new < remaining
        # Reservations and the margin protect others; a request alone may use the whole pool
        # (otherwise one whose output estimate exceeds the pool would wait forever).
        others = bool(self.transferring) or any(x is not r for x in self.running)
        own = 0.0
        if others and not chunked and self.role.reserves_output:
            own = self.ratio.reserved_tokens((r,))
        reserved = plan.reserved_tokens + own
        margin = int(self.config.safety_margin * self.kv.num_blocks) if fresh and others else 0
        if keys and not inline and admit_load(self, plan, r, hit, keys, reserved, margin):
            return Admission.ADMITTED  # its prefix loads beside the step, then it rejoins
        loading = len(keys) * inline * self.block_size
        if not self._allocate(r, loading + self.role.blocks_for(num_new, remaining), hit,
                              reserved, margin):
            return Admission.NO_MEMORY
        plan.reserved_tokens = reserved
        if fresh:
            self._start(r, computed)
            if inline:
                table = self.kv.block_ids(r.request_id)
                load_inline(plan, r, table[len(hit):len(hit) + len(keys)], keys)
        self._commit(plan, r, computed, num_new, chunked, fresh)
        return Admission.ADMITTED

    def _chunk_size(self, plan: StepPlan, r: Request, computed: int, remaining: int) -> int:
        """Prompt tokens the request gets now: all that remain, or a block-aligned chunk
        that fits the step's budgets; 0 when nothing fits or another request holds the one
        chunked-prefill slot."""
        if r.remote_prefill:
            return remaining  # computed elsewhere: takes blocks, not tokens
        num_new = plan.budget.chunk_size(computed, remaining)
        if (num_new < remaining and not self.role.concurrent_prefills
                and self.active_prefill not in (None, r)):
            return 0
        return num_new

    def _allocate(self, r: Request, num_tokens: int, hit: list, reserved: float,
                  margin: int) -> bool:
        """Blocks for `num_tokens` more tokens, if the pool also covers the `reserved`
        decode tokens and `margin` spare blocks; False (nothing changed) otherwise."""
        need = self.kv.blocks_needed(r, num_tokens, hit)
        need += cdiv(math.ceil(reserved), self.block_size) + margin
        return need <= self.kv.num_free and self.kv.allocate(r, num_tokens, hit)

    def _commit(self, plan: StepPlan, r: Request, computed: int, num_new: int,
                chunked: bool, fresh: bool) -> None:
        """Put an admitted request's chunk in the plan and advance its progress."""
        if r.remote_prefill:
            r.num_computed_tokens = r.prefill_target  # the prefill side writes this KV
            plan.out.transfer_ids.append(r.request_id)
            return
        # Only a newly chunked request spends the chunk allowance: the continuing chunk must
        # not starve short requests that fit whole (it still spends rem_input_tokens).
        plan.budget.spend(num_new, chunked and fresh)
        plan.num_prefills += 1
        if not self.role.concurrent_prefills:
            if chunked:
                self.active_prefill = r
            elif self.active_prefill is r:
                self.active_prefill = None
        if fresh:
            plan.out.new_requests.append(new_request(r))
        samples = computed + num_new == r.num_tokens
        plan.out.scheduled.append(ScheduledRequest(
            r.request_id, num_new, computed, self.kv.block_ids(r.request_id), samples, True))
        r.num_computed_tokens = computed + num_new
        r.num_in_flight += samples

    def _start(self, r: Request, num_cached: int) -> None:
        r.admit(num_cached, self.clock())
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
        acks = result.preempted_ack if self.config.executor_ahead else out.preempted_ids
        for rid in acks:
            self._on_preempt_ack(rid)
        if out.kv_loads:
            loads_done(self, out, result)
        outputs, self._pending_outputs = self._pending_outputs, []
        if result.cut:
            undo_step(self, out)
            return outputs
        requests, sampled, proposed, bs = (self.requests, result.sampled, result.proposed,
                                           self.block_size)
        speculating = bool(self.spec.planner.max_guesses)
        running, append = RequestStatus.RUNNING, self._append
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
            tokens = sampled.get(rid) if samples else None
            if samples and not tokens:
                self._finish(r, RequestStatus.FINISHED_ERROR, "the executor returned no token")
                outputs.append(self._output(r, []))
                continue
            if not x.is_prefill and num_new > 1:  # a verification: 1 to num_new tokens
                outputs.append(self.spec.apply(self.kv, r, x, tokens, result, self._append))
                continue
            if num_new > 1 or (computed + 1) % bs == 0:  # a block may have filled up
                self.kv.cache_computed(r, computed + num_new)
            if not samples:
                continue
            if r.fork_pending:
                outputs.extend(fork_siblings(self, r, tokens[1:]))
            if speculating:  # guesses held for its next step (none: not asked for)
                r.num_proposed = proposed.get(rid, 0)
            outputs.append(append(r, tokens[0]))
        return outputs

    def _on_preempt_ack(self, rid: str) -> None:
        r = self.preempted.pop(rid, None)
        if r is None:
            return  # aborted meanwhile
        r.status = RequestStatus.WAITING
        r.enqueue_step = self.step
        self.waiting.append(r)  # the tail: FIFO, keeping its generated tokens

    def _append(self, r: Request, token: int) -> RequestOutput:
        """The one place a token joins a request: then it finishes (a stop token, or at its
        length limit), leaves for its decode instance (a role that hands off), or goes on."""
        generated = r.output_token_ids
        generated.append(token)
        if token in r.stop_ids:  # EOS (unless ignore_eos) and stop_token_ids
            self._finish(r, RequestStatus.FINISHED_STOPPED)
        elif len(generated) >= r.out_limit:  # max_tokens or max_model_len
            self._finish(r, RequestStatus.FINISHED_LENGTH)
        else:  # it goes on, here or (a role that hands off) at its decode instance
            leaves = self.role.hands_off and r.status is RequestStatus.RUNNING
            if leaves:
                self._leave_for_transfer(r)
            return self._output(r, [token], leaves)
        return self._output(r, [token])

    def _output(self, r: Request, tokens: list[int], leaves: bool = False) -> RequestOutput:
        return RequestOutput(r.request_id, tokens, r.is_finished, r.finish_reason,
                             r.finish_message, r.parent_id, r.index, leaves,
                             cached_tokens=r.prompt_cached_tokens, queue_seconds=r.queue_seconds)

    def _leave_for_transfer(self, r: Request) -> None:
        self.running.remove(r)
        r.status = RequestStatus.TRANSFERRING
        self.transferring[r.request_id] = r

    def _end_now(self, r: Request, status: RequestStatus, message: str) -> None:
        """Finish a request inside schedule(); the next update() reports it."""
        self._finish(r, status, message)
        self._pending_outputs.append(self._output(r, []))

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
