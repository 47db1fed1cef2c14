"""How long a step takes, as the scheduler can ask it: a step's shape, the `StepTimeModel`
protocol (the simulator's roofline `CostModel` is one), and `LearnedStepTime`, which fits
measured step times online.

The SLO policy plans with these predictions; nothing here imports torch or reads a clock.
"""

from __future__ import annotations

from collections import deque
from operator import attrgetter
from typing import TYPE_CHECKING, Iterable, Mapping, Protocol

if TYPE_CHECKING:
    from tidal.core.outputs import SchedulerOutput
    from tidal.core.request import Request


class StepShape:
    """The totals of one step that a step-time model needs."""

    __slots__ = ("tokens", "seqs", "sampled", "pairs", "kv_tokens", "gathered", "adapters",
                 "adapter_tokens", "prompt")

    def __init__(self, entries: Iterable[tuple[int, int, bool]] = ()) -> None:
        """entries: (new tokens, cached tokens before them, samples a token)."""
        self.tokens = self.seqs = self.sampled = self.pairs = self.kv_tokens = 0
        self.gathered = 0
        self.adapters = 0  # distinct LoRA adapters the step runs (their weights are read)
        self.adapter_tokens = 0  # tokens whose rows run through an adapter
        self.prompt = 0  # 1 when some entry computes more than one position: a prompt chunk
        for n, c, samples in entries:
            self.add(n, c, samples)

    def add(self, n: int, c: int, samples: bool = True, count: int = 1,
            adapter: bool = False) -> "StepShape":
        """Add `count` entries of n new tokens after c cached ones (through a LoRA adapter
        if `adapter`; the caller counts distinct adapters in `adapters`); returns self."""
        self.tokens += n * count
        if adapter:
            self.adapter_tokens += n * count
        self.seqs += count
        if n > 1:
            self.prompt = 1
        self.sampled += samples * count
        self.pairs += (n * c + n * (n + 1) // 2) * count  # (query, key) pairs, causal mask
        self.kv_tokens += (c + 2 * n) * count  # context read, new tokens written and read
        if c:  # attends through the block table: the context is read back from the cache
            self.gathered += (c + n) * count
        return self

    def copy(self) -> "StepShape":
        other = StepShape.__new__(StepShape)
        for name in StepShape.__slots__:
            setattr(other, name, getattr(self, name))
        return other

    @classmethod
    def decodes(cls, rows: Iterable[tuple[int, str | None]]) -> "StepShape":
        """One decode row for each (cached tokens, LoRA adapter or None) of `rows`."""
        shape, names = cls(), set()
        for c, lora in rows:
            shape.add(1, c, adapter=lora is not None)
            names.add(lora)
        names.discard(None)
        shape.adapters = len(names)
        return shape

    @classmethod
    def of(cls, out: "SchedulerOutput",
           requests: "Mapping[str, Request] | None" = None) -> "StepShape":
        """The step's shape. A decode entry of 1 + k positions (k guesses) runs as 1 + k
        decode rows, and counts so. `requests`: the scheduler's, to count LoRA adapters
        (None where no request has one: `LoraRule.seen`)."""
        seqs = len(out.scheduled)
        if requests is not None or out.kind != "decode" or out.num_tokens != seqs:
            shape, names = cls(), set()
            for s in out.scheduled:
                n, c = s.num_new_tokens, s.num_computed_tokens
                r = requests.get(s.request_id) if requests is not None else None
                name = r.lora if r is not None else None
                if name is not None:
                    names.add(name)
                if s.is_prefill:
                    shape.add(n, c, s.samples, adapter=name is not None)
                else:
                    for j in range(n):
                        shape.add(1, c + j, adapter=name is not None)
            shape.adapters = len(names)
            return shape
        # The simulator's hot path, the common step: every entry one new, sampled token
        # after c >= 1 cached ones, so the totals need only the sum of c (in one C pass).
        shape = cls.__new__(cls)
        context = sum(map(_CACHED, out.scheduled))
        shape.tokens = shape.seqs = shape.sampled = seqs
        shape.pairs = shape.gathered = context + seqs
        shape.kv_tokens = context + 2 * seqs
        shape.adapters = shape.adapter_tokens = shape.prompt = 0
        return shape


_CACHED = attrgetter("num_computed_tokens")


class StepTimeModel(Protocol):
    """Predicts the seconds a step of a given shape takes on this engine."""

    def shape_time(self, shape: StepShape) -> float: ...


# The linear step-time models' terms: seconds per step, new token, sequence, attention
# pair, KV token, LoRA adapter run, token through an adapter, and step with a prompt (a
# prompt's step pays once for its path: on CPU the tiles' dequantized weights, or twice
# rounded rows; on GPU eager kernels where decode steps replay graphs).
STEP_TIME_TERMS = ("step", "token", "seq", "pair", "kv_token", "adapter", "adapter_token",
                   "prompt_step")
_BASE_TERMS = 5  # a model of the first five terms prices adapters at nothing
# The lengths a list of coefficients may have: the first five, seven (before prompt_step) or all
_KNOWN_LENGTHS = (_BASE_TERMS, 7, len(STEP_TIME_TERMS))
_PROMPT_STEP = STEP_TIME_TERMS.index("prompt_step")


def _terms(shape: StepShape) -> tuple[int, ...]:
    """The shape's count of each of STEP_TIME_TERMS."""
    return (1, shape.tokens, shape.seqs, shape.pairs, shape.kv_tokens, shape.adapters,
            shape.adapter_tokens, shape.prompt)


class LinearStepTime:
    """A fixed linear step-time model: seconds = the sum of each of `STEP_TIME_TERMS` times
    its coefficient, e.g. the one a server learned (`LearnedStepTime.coefficients()`), for
    the simulator to time steps as that server plans them. Fewer coefficients (a profile of
    an earlier version) price the terms they lack at nothing."""

    def __init__(self, coefficients: Iterable[float]) -> None:
        coef = list(coefficients)
        if len(coef) not in _KNOWN_LENGTHS:
            raise ValueError(f"a linear step-time model has {len(STEP_TIME_TERMS)} "
                             f"coefficients ({', '.join(STEP_TIME_TERMS)}), got {len(coef)}")
        self.coef = tuple(coef + [0.0] * (len(STEP_TIME_TERMS) - len(coef)))

    def shape_time(self, shape: StepShape) -> float:
        if shape.seqs == 0:
            return 0.0
        a, b, c, d, e, f, g, h = self.coef  # spelled out: the simulator asks this every step
        return (a + b * shape.tokens + c * shape.seqs + d * shape.pairs + e * shape.kv_tokens
                + f * shape.adapters + g * shape.adapter_tokens + h * shape.prompt)


# The quantiles of predicted / measured step seconds an engine reports (its metrics, and
# the simulator's scatter of step times around a learned model's predictions).
ERROR_QUANTILES = (0.01, 0.1, 0.25, 0.5, 0.75, 0.9, 0.99)


class PredictionLog:
    """Predicted over measured seconds of the last `window` steps: how far a step-time
    model is off on this engine (1: exact; above 1: it overestimates)."""

    def __init__(self, window: int = 512) -> None:
        self.ratios: deque[float] = deque(maxlen=window)

    def record(self, predicted: float, measured: float) -> None:
        if predicted > 0 and measured > 0:
            self.ratios.append(predicted / measured)

    def quantiles(self, *qs: float) -> list[float]:
        """The ratios' quantiles (nearest rank); 0 for each while none is recorded."""
        ordered = sorted(self.ratios)
        if not ordered:
            return [0.0] * len(qs)
        return [ordered[min(len(ordered) - 1, int(q * len(ordered)))] for q in qs]


class LearnedStepTime:
    """A step-time model learned from the engine's own steps: seconds = a + b * tokens +
    c * seqs + d * attention pairs + e * KV tokens + h * (the step computes a prompt) (+ f *
    LoRA adapters + g * tokens through them, once steps with adapters are seen), fitted by
    least squares over the last `window` steps with weights that halve every `half_life`
    steps (so it follows a machine whose speed drifts), every coefficient >= 0. It predicts
    0 until it has seen `min_steps` steps. Until `min_steps` of them computed prompts (more
    tokens than sequences), the per-token and attention terms stay out of the fit: a slope
    from a few small steps would extrapolate wildly to long prompts, and an overestimate
    makes the slo policy reject requests it could serve (and then never see the steps that
    would correct it), whereas an underestimate only admits a little too much until the fit
    learns.

    `fixed_penalty` makes the fit prefer a small constant: a pseudo-step of the constant
    alone, due zero seconds, weighs that fraction of the steps. Steps that cannot tell a
    fixed cost from a per-row one (all of one size, or of a narrow range of sizes, with
    noise) then put the time on the rows, so one more row is priced near its step's average
    row and never as nearly free. The speculation planner's model wants that (a guess priced
    too cheaply at a large batch costs seconds); the slo policy's does not (0: the constant
    takes what the steps leave undecided, which keeps a long prompt's prediction low). With
    a penalty the model predicts 0 while its decode steps are all of one size, or those of
    other sizes weigh less than the pseudo-step: it could only price a row at its step's
    average, at one row the whole step, and a planner told so would never try a guess
    again.

    `prior`: (shape, seconds) of steps timed before serving, kept in every fit."""

    # Feature scales keep the normal equations well conditioned (coefficients near 1e-3).
    _SCALES = (1.0, 1e-3, 1e-2, 1e-6, 1e-4, 1.0, 1e-3, 1.0)
    # constant, seqs, KV tokens and the adapter terms: what decode steps pin down
    _DECODE_FEATURES = [0, 2, 4, 5, 6]

    def __init__(self, window: int = 512, half_life: float = 128.0, min_steps: int = 8,
                 refit_every: int = 8, fixed_penalty: float = 0.0,
                 prior: Iterable[tuple[StepShape, float]] = (),
                 prior_weight: float = 1.0) -> None:
        self.samples: deque[tuple[tuple[float, ...], float]] = deque(maxlen=window)
        self.decay = 0.5 ** (1.0 / half_life)
        self.min_steps, self.refit_every = min_steps, refit_every
        self.fixed_penalty = fixed_penalty
        self.coef: list[float] = [0.0] * len(self._SCALES)
        self._since_fit = 0
        # Steps timed before serving (a start-up profile): in every fit, each weighing as
        # `prior_weight` fresh steps, so the model predicts from the first step and still
        # prices prompts after a long run of decodes has filled the window.
        self.prior = [(self._features(s), y) for s, y in prior if s.seqs and y > 0]
        self.prior_weight = prior_weight
        self._prior_prompts = any(self._computes_prompt(x) for x, _ in self.prior)
        if self.prior:
            self.coef = self._fit()

    def add_prior(self, steps: Iterable[tuple[StepShape, float]]) -> None:
        """Add steps timed apart from serving (the rest of a start-up profile, timed while
        the engine idles) to the prior, and refit."""
        added = [(self._features(s), y) for s, y in steps if s.seqs and y > 0]
        if added:
            self.prior += added
            self._prior_prompts = any(self._computes_prompt(x) for x, _ in self.prior)
            self.coef = self._fit()

    def _features(self, shape: StepShape) -> tuple[float, ...]:
        return tuple(x * s for x, s in zip(_terms(shape), self._SCALES))

    def _computes_prompt(self, x: tuple[float, ...]) -> bool:
        return x[1] / self._SCALES[1] > x[2] / self._SCALES[2] + 0.5  # tokens > seqs

    def observe(self, shape: StepShape, seconds: float) -> None:
        """Record one measured step."""
        if shape.seqs == 0 or seconds <= 0:
            return
        self.samples.append((self._features(shape), seconds))
        self._since_fit += 1
        if (self._since_fit >= self.refit_every
                and len(self.samples) + len(self.prior) >= self.min_steps):
            self._since_fit = 0
            self.coef = self._fit()

    def shape_time(self, shape: StepShape) -> float:
        if shape.seqs == 0:
            return 0.0
        return sum(c * x for c, x in zip(self.coef, self._features(shape)))

    @property
    def prices_prompts(self) -> bool:
        """Whether the fit prices a prompt's tokens (or their attention) yet."""
        return self.coef[1] > 0 or self.coef[3] > 0

    def coefficients(self) -> list[float]:
        """The fit's seconds per unit of each of STEP_TIME_TERMS (a `LinearStepTime`'s)."""
        return [c * s for c, s in zip(self.coef, self._SCALES)]

    def _one_size(self, samples, weights: list[float]) -> bool:
        """Whether the decode steps are, in effect, all of one size: those of other sizes
        weigh less than the fixed cost's pseudo-step. The fit would then price one more row
        at the whole step (at one request, a planner's verifications aged out of the fit
        made every guess look dear, and it stopped guessing for ~500 steps at a time)."""
        by_size: dict[float, float] = {}
        for (x, _), w in zip(samples, weights):
            if not self._computes_prompt(x):
                by_size[x[2]] = by_size.get(x[2], 0.0) + w
        others = sum(by_size.values()) - max(by_size.values(), default=0.0)
        return others <= self.fixed_penalty * sum(weights)

    def _fit(self) -> list[float]:
        """Weighted non-negative least squares by active set: solve, drop the features whose
        coefficients come out negative, solve again (at most five rounds)."""
        n = len(self._SCALES)
        # Relative errors count (1/y^2): a long prompt's seconds would drown decode steps.
        weights = [self.prior_weight / (y * y) for _, y in self.prior]
        weights += [self.decay ** age / (y * y)
                    for age, (_, y) in zip(range(len(self.samples) - 1, -1, -1), self.samples)]
        samples = self.prior + list(self.samples)
        if self.fixed_penalty and self._one_size(samples, weights):
            return [0.0] * n  # decode steps of one size: no price for one more row yet
        active = list(range(n))
        prompts = sum(map(self._computes_prompt, (x for x, _ in samples)))
        if prompts < self.min_steps and not self._prior_prompts:
            active = list(self._DECODE_FEATURES)  # and only the decode steps to fit them
            kept = [i for i, (x, _) in enumerate(samples) if not self._computes_prompt(x)]
            samples, weights = [samples[i] for i in kept], [weights[i] for i in kept]
            if not samples:
                return self.coef
        # the adapter and prompt-step terms only once steps with them are seen (a fit without
        # LoRA costs what it did before them)
        active = [i for i in active if i < _BASE_TERMS or any(x[i] for x, _ in samples)]
        if _PROMPT_STEP in active and len({x[1] for x, _ in samples if x[_PROMPT_STEP]}) < 2:
            active.remove(_PROMPT_STEP)  # one prompt size can't split its step from its tokens
        while active:
            coef = _solve_weighted(samples, weights, active, self.fixed_penalty)
            if coef is None:
                return self.coef  # degenerate (one step size so far): keep the old fit
            negative = [i for i, c in zip(active, coef) if c < 0]
            if not negative:
                full = [0.0] * n
                for i, c in zip(active, coef):
                    full[i] = c
                return full
            active = [i for i in active if i not in negative]
        return self.coef


def _solve_weighted(samples, weights, active: list[int],
                    fixed_penalty: float = 0.0) -> list[float] | None:
    """argmin sum w (y - x[active] . b)^2 + fixed_penalty * sum w * b_0^2 (b_0 the
    constant's coefficient, when active), with a tiny ridge; None if singular."""
    k = len(active)
    a = [[0.0] * k for _ in range(k)]
    rhs = [0.0] * k
    for (x, y), w in zip(samples, weights):
        xs = [x[i] for i in active]
        for r in range(k):
            wx = w * xs[r]
            rhs[r] += wx * y
            row = a[r]
            for c in range(k):
                row[c] += wx * xs[c]
    ridge = 1e-9 * max(a[r][r] for r in range(k))  # steadies features that barely vary
    for r in range(k):
        a[r][r] += ridge
    if fixed_penalty and active[0] == 0:  # the constant's pseudo-step: x = (1, 0, ...), y = 0
        a[0][0] += fixed_penalty * sum(weights)
    return _gauss(a, rhs)


def _gauss(a: list[list[float]], b: list[float]) -> list[float] | None:
    """Solve a x = b by Gaussian elimination with partial pivoting; None if singular."""
    n = len(b)
    m = [row[:] + [v] for row, v in zip(a, b)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[pivot][col]) < 1e-12:
            return None
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(col + 1, n):
            f = m[r][col] / m[col][col]
            for c in range(col, n + 1):
                m[r][c] -= f * m[col][c]
    x = [0.0] * n
    for r in range(n - 1, -1, -1):
        x[r] = (m[r][n] - sum(m[r][c] * x[c] for c in range(r + 1, n))) / m[r][r]
    return x
