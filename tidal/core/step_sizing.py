"""Steps sized by time: the prefill tokens a step may add so that its predicted time, and so
the running decodes' wait for their next token, stays within a target (Sarathi-Serve's
stall-free batching). Every policy sizes its steps through `cap_prefill`; the step-time
model is the scheduler's."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Callable, Iterable

from tidal.core.step_time import StepShape, StepTimeModel

if TYPE_CHECKING:
    from tidal.core.step_time import LearnedStepTime
    from tidal.core.budget import StepPlan
    from tidal.core.request import Request
    from tidal.core.scheduler import Scheduler


# A step's target on CPU when none is given: streams wait at most this for their next
# token while prompts are computed beside them (a few hundred prompt tokens a step on a
# 2-core VM).
CPU_MAX_STEP_MS = 400.0
EFFICIENT_CHUNK = 256  # prompt tokens a step needs to compute them near full speed on CPU


def default_step_target(on_gpu: bool, model: "StepTimeModel | None") -> float:
    """`max_step_ms` when none is given. On a GPU none (0): its token budgets already keep
    steps short. On a CPU, where a step of those budgets takes tens of seconds,
    CPU_MAX_STEP_MS, or the predicted time of a prompt chunk of EFFICIENT_CHUNK tokens on a
    machine where that takes longer (smaller chunks compute prompts more slowly)."""
    if on_gpu:
        return 0.0
    chunk = model.shape_time(StepShape().add(EFFICIENT_CHUNK, 0)) if model else 0.0
    return max(CPU_MAX_STEP_MS, round(chunk * 1000))


class StepTarget:
    """The seconds a step should take (`seconds`; inf: no target) and the prompt tokens a
    step may hold whatever the model predicts (`prompt_cap`). Fixed (a given max_step_ms),
    or, following `model` (a CPU server's when none is given), the machine's default
    target as that model prices it now: it follows the model as it learns. Until the
    model prices prompt tokens, a step holds at most EFFICIENT_CHUNK of them, so that a
    server can serve before it has timed a prompt (a long prompt would otherwise look free
    and take one step whole)."""

    def __init__(self, seconds: float = math.inf,
                 model: "LearnedStepTime | None" = None) -> None:
        self._seconds, self.model = seconds, model
        self._coef: list[float] | None = None  # the model's fit the target was priced by

    @classmethod
    def of_ms(cls, ms: float | None) -> "StepTarget":
        """A fixed target of `ms` milliseconds (None or 0: none)."""
        return cls(ms / 1000 if ms else math.inf)

    @property
    def seconds(self) -> float:
        if self.model is not None and self.model.coef is not self._coef:
            self._coef = self.model.coef  # a new fit: price the chunk again (once a fit)
            self._seconds = default_step_target(False, self.model) / 1000
        return self._seconds

    @property
    def prompt_cap(self) -> float:
        unpriced = self.model is not None and not self.model.prices_prompts
        return EFFICIENT_CHUNK if unpriced else math.inf


def lone_prompt_target(sched: "Scheduler", decoding: list["Request"], target: float) -> float:
    """The target of a step whose only work is one prompt (nothing decoding, no other prompt
    waiting or prefilling): at least the time at which the step's fixed costs, those of a
    one-token prompt, are `lone_prompt_fixed_share` of it. Chunking a prompt alone gives no
    one an earlier token; each chunk pays those costs again."""
    share = sched.config.lone_prompt_fixed_share
    if decoding or prompts_to_compute(sched) != 1 or share <= 0 or sched.step_time is None:
        return target
    return max(target, sched.step_time.shape_time(StepShape().add(1, 0)) / share)


def decode_shape(decoding: Iterable["Request"]) -> StepShape:
    """The shape of one decode row for each of `decoding`, at its current context (through
    its LoRA adapter, if it has one)."""
    return StepShape.decodes((r.num_computed_tokens, r.lora) for r in decoding)


def cap_prefill(sched: "Scheduler", plan: "StepPlan", decode: StepShape,
                target: float) -> int:
    """Cap the plan's token budgets so that `decode` plus the step's prompt tokens is
    predicted to take at most `target` seconds; returns the prompt tokens allowed. At least
    one block, so prompts always move (decodes that alone take the target still run, with
    that block beside them)."""
    budget, bs = plan.budget, sched.block_size
    # the input budget, not the chunk budget: whole prompts that need no chunk take the
    # input budget alone, so a chunk budget of a block must not leave them uncapped
    room = min(budget.rem_input_tokens, max(bs, sched.target.prompt_cap))
    if room <= bs:
        return room
    step = prompt_step(sched, decode)
    tokens = bs * largest(1, room // bs, lambda k: step(k * bs) <= target)
    budget.rem_input_tokens = min(budget.rem_input_tokens, tokens)
    budget.rem_chunk_tokens = min(budget.rem_chunk_tokens, tokens)
    return tokens


def prompt_step(sched: "Scheduler", decode: StepShape) -> Callable[[int], float]:
    """Predicted seconds of a step of `decode` plus n prompt tokens, as a function of n:
    first the rest of the chunked prompt (which attends to what it computed), then pieces
    of the mean prompt still to compute."""
    model, active, length = sched.step_time, sched.active_prefill, prompt_length(sched)
    first = ((active.prefill_target - active.num_computed_tokens, active.num_computed_tokens)
             if active is not None else (0, 0))
    return lambda tokens: model.shape_time(with_prompts(decode, tokens, first, length))


def prompt_length(sched: "Scheduler") -> int:
    """The mean prompt still to compute of the running prefills and the waiting queue: a
    step's prefill tokens come as pieces of about that length, which is what its attention
    cost depends on (one 8k-token sequence costs far more than 64 of 128)."""
    total = sched.prefill_backlog(sched.waiting)
    return max(1, total // max(1, prompts_to_compute(sched)))


def prompts_to_compute(sched: "Scheduler") -> int:
    """The running prefills and the waiting requests."""
    return sum(1 for r in sched.running if r.is_prefilling) + len(sched.waiting)


def with_prompts(decode: StepShape, tokens: int, first: tuple[int, int],
                 length: int) -> StepShape:
    """`decode` plus `tokens` prompt tokens: first up to `first` = (tokens left, tokens
    computed) of the chunked prompt, then pieces of `length`."""
    shape = decode.copy()
    left, computed = first
    if left:
        shape.add(min(left, tokens), computed)
        tokens -= min(left, tokens)
    whole, rest = divmod(tokens, length)
    if whole:
        shape.add(length, 0, count=whole)
    if rest:
        shape.add(rest, 0)
    return shape


def largest(lo: int, hi: int, ok: Callable[[int], bool]) -> int:
    """The largest k in [lo, hi] with ok(k), for ok monotone (true up to some k); lo when
    even lo fails."""
    if ok(hi):
        return hi
    while lo < hi - 1:
        mid = (lo + hi) // 2
        if ok(mid):
            lo = mid
        else:
            hi = mid
    return lo
