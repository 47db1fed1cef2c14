"""Speculative decoding as the scheduler sees it: how many tokens each decoding request
guesses in a step, their KV slots, and what a verification does to the request.

A request that guesses k tokens is scheduled 1 + k positions: its last known token and the
k guesses its executor's proposer made. The forward pass verifies them; the executor returns
the accepted guesses plus one token of the model's own (1 to k + 1 tokens), and the
scheduler rolls the rest back (`Scheduler.update`). Nothing here knows the guessed tokens:
proposers live with the executor, which reports how many it holds for each request.
"""

from __future__ import annotations

import heapq
from typing import TYPE_CHECKING, Callable, Iterable, Sequence

from tidal.core.outputs import ModelOutput, RequestOutput, ScheduledRequest
from tidal.core.request import Request, RequestStatus
from tidal.core.step_sizing import StepTarget
from tidal.core.step_time import StepShape, StepTimeModel

if TYPE_CHECKING:
    from tidal.core.budget import StepPlan
    from tidal.core.config import SchedulerConfig
    from tidal.core.kv_cache_manager import KVCacheManager

# Verifications a request's acceptance estimate remembers: counts decay by this per update;
# the engine-wide estimates (a request's prior) remember more.
ACCEPTANCE_DECAY = 0.9
ENGINE_DECAY = 0.99
# Verifications' worth of the prior in a request's estimate: its own few verifications
# move it, but a proposal's length says as much as they do about a guess's chance.
PRIOR_WEIGHT = 4.0
# The learned step-time model the planner prices guesses with prefers a small fixed cost
# by this much (`LearnedStepTime.fixed_penalty`): steps of a narrow range of sizes, as a
# large batch's first ones are, hardly say what one more row costs, and the fit then puts
# the time on the rows (without it, 64 clients' first steps of 79 rows on a 2-core CPU were
# fitted as 163 ms fixed and 1.3 ms a row, where a row cost ~3.5). Steps of 6 ms + 2.5 ms
# a row with 5% noise, at 1 and 16 rows, still give 5.8 ms fixed.
GUESS_FIXED_PENALTY = 0.03


def acceptance(r: Request, prior: float = 0.5) -> float:
    """The estimated chance that one more guess of `r` is accepted, given the ones before it
    were, from r's verifications of proposals as long as the one its proposer holds now:
    accepted guesses over accepted guesses plus rejections (each verification that ends
    early is one rejection; guesses after it were never tested), with `PRIOR_WEIGHT`
    pseudo-counts split as `prior`. Kept per length because a long proposal passes far more
    often than a short one of the same request (a suffix match's length). A request that
    never verified a proposal of that length is taken at least even (so that it tries,
    whatever the others did)."""
    counts = r.spec_counts.get(r.num_proposed)
    if counts is None:
        return max(prior, 0.5)
    hits, misses = counts
    return (hits + PRIOR_WEIGHT * prior) / (hits + misses + PRIOR_WEIGHT)


def record_verification(r: Request, guessed: int, accepted: int) -> None:
    """Fold one verification of `guessed` tokens (at least one), `accepted` of them
    accepted, planned from the `r.num_proposed` its proposer held, into r's decayed counts
    for that length."""
    counts = r.spec_counts.setdefault(r.num_proposed, [0.0, 0.0])
    counts[0] = counts[0] * ACCEPTANCE_DECAY + accepted
    counts[1] = counts[1] * ACCEPTANCE_DECAY + (accepted < guessed)


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens a verification of k guesses emits on average when each is accepted with
    probability alpha after the ones before it: 1 + alpha + ... + alpha^k."""
    return float(k + 1) if alpha >= 1.0 else (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


class GuessPlanner:
    """Chooses each decoding request's number of guesses for a step, once its own decode is
    scheduled.

    The cap per request is the fewest of: `max_guesses`, the guesses its proposer holds, and
    the output it may still produce besides the tokens in flight (the model's own token
    always comes).

    Adaptive (with a step-time model that predicts): start from no guesses and add one at a
    time, the one most likely to be accepted first, while it raises expected tokens per
    second of step time (and, given a TPOT target per request, keeps each request's
    expected time per token within it; given a step `target`, keeps the step within it). Each guess runs as one more decode row of context
    c + j, which is how the step-time model prices it. At a batch where one more row costs
    more than the tokens it is expected to add, no request guesses. Otherwise (or before the
    model predicts): every request guesses its cap, though without a prediction only every
    other step and no more than `max_guesses` in all: a large batch's first steps do not
    grow to many times their rows while the model learns what a row costs, and it sees
    steps of two sizes, which it needs to price a row."""

    def __init__(self, max_guesses: int, adaptive: bool,
                 step_time: StepTimeModel | None,
                 tpot: Callable[[Request], float | None] | None = None,
                 target: StepTarget | None = None) -> None:
        self.max_guesses = max_guesses
        self.adaptive = adaptive
        self.step_time = step_time
        self.tpot = tpot  # a request's TPOT target in seconds, where the policy has one
        self.target = target or StepTarget()  # the scheduler's: seconds a step should take
        # every request's verifications, decayed, by how many tokens its proposer held
        # (hits, misses): the prior of a request whose proposer holds that many. A suffix
        # proposer holds more after a longer match, and its guesses pass more often (chat,
        # one at a time: ~20% of first guesses after a 2-guess proposal, ~90% after 8)
        self.by_proposal = [[0.0, 0.0] for _ in range(max_guesses + 1)]
        self._probe = False  # whether the last step planned without a prediction guessed

    def prior(self, r: Request) -> float:
        return self._prior(r.num_proposed)

    def _prior(self, proposed: int) -> float:
        hits, misses = self.by_proposal[min(proposed, self.max_guesses)]
        return (hits + 1.0) / (hits + misses + 2.0)

    def record(self, r: Request, guessed: int, accepted: int) -> None:
        """A verification of r (at least one guess), planned from the `r.num_proposed`
        tokens its proposer held: its counts and the engine's."""
        record_verification(r, guessed, accepted)
        counts = self.by_proposal[min(r.num_proposed, self.max_guesses)]
        counts[0] = counts[0] * ENGINE_DECAY + accepted
        counts[1] = counts[1] * ENGINE_DECAY + (accepted < guessed)

    def alpha(self, r: Request) -> float:
        return acceptance(r, self.prior(r))

    def cap(self, r: Request) -> int:
        # num_in_flight counts this step's own token already (it is scheduled first)
        room = r.out_limit - len(r.output_token_ids) - r.num_in_flight
        return max(0, min(self.max_guesses, r.num_proposed, room))

    def plan(self, entries: Sequence[tuple[Request, int]],
             budget: int) -> tuple[list[int], bool]:
        """The step's guesses (see `choose`), and whether the runner should guess ahead for
        the next one (see `worth_proposing`), pricing the decode rows once."""
        shape, base = self._base(entries)
        guesses = self._choose(entries, budget, shape, base)
        return guesses, any(guesses) or self._worth(entries, shape, base)

    def choose(self, entries: Sequence[tuple[Request, int]], budget: int) -> list[int]:
        """Guesses per entry of (request, tokens in its KV cache before this step's), at
        most `budget` in all."""
        return self._choose(entries, budget, *self._base(entries))

    def worth_proposing(self, entries: Sequence[tuple[Request, int]]) -> bool:
        """Whether a guess could pay at this batch: one as likely as the likeliest
        request's, or as a proposal of the likeliest length (what proposers will hold is not
        known yet), for one more row. Only then are proposers asked to guess ahead (they
        cost the runner time for every request it samples)."""
        return self._worth(entries, *self._base(entries))

    def _choose(self, entries: Sequence[tuple[Request, int]], budget: int, shape: StepShape,
                base: float) -> list[int]:
        caps = [self.cap(r) for r, _ in entries]
        if not any(caps) or budget <= 0:
            return [0] * len(entries)
        if not self.adaptive:
            return _fill(caps, budget)
        if base <= 0.0:  # no prediction yet: one request's worth, every other step
            self._probe = not self._probe  # so that the model sees two step sizes
            return _fill(caps, min(budget, self.max_guesses) if self._probe else 0)
        return self._adaptive(entries, caps, budget, shape, base)

    def _worth(self, entries: Sequence[tuple[Request, int]], shape: StepShape,
               base: float) -> bool:
        if base <= 0.0 or not entries:
            return True
        # not the requests' own estimates alone: a request whose short proposals failed
        # would never propose again, and never show that its long ones pass (suffix on
        # chat prompts, one at a time: 0.91-0.94x of no speculation, its bound 1.6-1.75x)
        alpha = max(max(self.alpha(r) for r, _ in entries),
                    max(self._prior(n) for n in range(1, self.max_guesses + 1)))
        r, c = entries[0]
        with_guess = self.step_time.shape_time(shape.copy().add(1, c + 1,
                                                                adapter=r.lora is not None))
        return (len(entries) + alpha) * base > len(entries) * with_guess

    def _base(self, entries: Sequence[tuple[Request, int]]) -> tuple[StepShape, float]:
        """The decode rows' shape and predicted seconds (0: not adaptive, or no prediction
        yet)."""
        shape = StepShape.decodes((c, r.lora) for r, c in entries)
        model = self.step_time if self.adaptive else None
        return shape, model.shape_time(shape) if model is not None else 0.0

    def _adaptive(self, entries: Sequence[tuple[Request, int]], caps: list[int], budget: int,
                  shape: StepShape, seconds: float) -> list[int]:
        guesses = [0] * len(entries)
        alphas = [self.alpha(r) for r, _ in entries]
        targets = [self.tpot(r) if self.tpot else None for r, _ in entries]
        tokens = float(len(entries))  # each entry emits its own token for sure
        heap = [(-a, i) for i, a in enumerate(alphas) if caps[i]]
        heapq.heapify(heap)
        while heap and budget > 0:
            neg_gain, i = heapq.heappop(heap)
            k = guesses[i]
            r, c = entries[i]
            trial = shape.copy().add(1, c + k + 1, adapter=r.lora is not None)
            t = self.step_time.shape_time(trial)
            gain = -neg_gain
            if (tokens + gain) * seconds <= tokens * t or t > self.target.seconds:
                break  # the likeliest guess left does not pay for its row (or fit): none will
            if not self._meets_targets(guesses, alphas, targets, i, t):
                continue
            guesses[i], shape, seconds, tokens = k + 1, trial, t, tokens + gain
            budget -= 1
            if k + 1 < caps[i]:
                heapq.heappush(heap, (-(gain * alphas[i]), i))
        return guesses

    @staticmethod
    def _meets_targets(guesses: list[int], alphas: list[float],
                       targets: list[float | None], grown: int, seconds: float) -> bool:
        """Whether a step of `seconds`, with one more guess for entry `grown`, keeps every
        request with a TPOT target within it: step time over its expected tokens."""
        for i, target in enumerate(targets):
            if target is None:
                continue
            k = guesses[i] + (i == grown)
            if seconds > target * expected_tokens(alphas[i], k):
                return False
        return True


def guess_budget(plan: "StepPlan", prompts: Iterable[Request],
                 kv_arrives: Callable[[Request], bool]) -> int:
    """The step's input budget that guesses may take: what the prompt tokens still to compute
    (of `prompts`, but those whose KV `kv_arrives` from a prefill instance) leave of it.
    Under load, with prompts queued, a step's budget goes to them and nobody guesses."""
    left = plan.budget.rem_input_tokens
    for r in prompts:
        if left <= 0:
            break
        if not kv_arrives(r):
            left -= max(0, r.num_tokens - r.num_computed_tokens)
    return max(0, left)


def _fill(caps: list[int], budget: int) -> list[int]:
    """Every entry its cap, in order, until the budget runs out."""
    out = []
    for cap in caps:
        take = min(cap, budget)
        out.append(take)
        budget -= take
    return out


class Speculation:
    """The scheduler's side of speculative decoding: it grows planned decodes by the
    planner's guesses and applies verifications; counts what was guessed and accepted."""

    def __init__(self, config: "SchedulerConfig", step_time: StepTimeModel | None,
                 tpot: Callable[[Request], float | None], target: StepTarget) -> None:
        self.planner = GuessPlanner(config.num_speculative_tokens, config.speculative_adaptive,
                                    step_time, tpot, target)
        self.drafted_tokens = 0  # guesses verified
        self.accepted_tokens = 0  # of those, accepted
        self.verifications = 0  # decode entries that verified at least one guess

    def add_guesses(self, kv: "KVCacheManager", requests: dict[str, Request],
                    plan: "StepPlan", entries: list[ScheduledRequest], budget: int) -> None:
        """Grow decode entries (each already holding its own token's slot) to 1 + k
        positions, at most `budget` guesses in all (the input budget that prompts waiting to
        be computed leave) and from blocks nobody else needs this step: guesses never
        retract anyone nor hold a prompt back, and their blocks return at update."""
        pairs = [(requests[x.request_id], x.num_computed_tokens) for x in entries]
        chosen, plan.out.propose = self.planner.plan(pairs, budget)
        for x, (r, _), k in zip(entries, pairs, chosen):
            if not k or not kv.allocate(r, k):  # r.num_computed_tokens is computed + 1
                continue
            x.num_new_tokens = 1 + k
            x.block_ids = kv.block_ids(r.request_id)
            r.num_computed_tokens += k
            r.num_guesses = k
            plan.budget.spend(k, False)

    def apply(self, kv: "KVCacheManager", r: Request, x: ScheduledRequest, tokens: list[int],
              result: ModelOutput, append: Callable[[Request, int], RequestOutput],
              ) -> RequestOutput:
        """A verification: the accepted guesses and the model's own token join the request
        through `append` (up to a stop), the rejected positions roll back, and the blocks
        that hold none of its tokens return to the pool. Only then are its full blocks
        published."""
        guessed = x.num_new_tokens - 1
        tokens = tokens[:guessed + 1]
        accepted = len(tokens) - 1
        r.num_guesses = 0
        r.num_computed_tokens = x.num_computed_tokens + 1 + accepted
        kv.trim(r)
        drafted = result.drafted.get(r.request_id, guessed)
        if drafted:  # none: the proposer had nothing left to guess when the step ran
            self.planner.record(r, drafted, accepted)
            self.verifications += 1
            self.drafted_tokens += drafted
            self.accepted_tokens += accepted
        r.num_proposed = result.proposed.get(r.request_id, 0)
        for count, token in enumerate(tokens, start=1):
            out = append(r, token)
            if r.status is not RequestStatus.RUNNING:
                break
        else:
            kv.cache_computed(r, r.num_computed_tokens)
        out.new_token_ids = tokens[:count]
        return out
