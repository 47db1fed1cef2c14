"""A request's state as the scheduler sees it: tokens, progress, status and limits."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, replace
from typing import Any, Hashable


class RequestStatus(enum.Enum):
    """Where a request is in its lifecycle."""

    WAITING = "waiting"  # queued for (re-)admission
    RUNNING = "running"  # holds blocks; prefilling or decoding
    PREEMPTED = "preempted"  # retracted; waits for the executor's ack before WAITING
    TRANSFERRING = "transferring"  # holds blocks while its KV moves between instances
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"
    FINISHED_ERROR = "finished_error"
    FINISHED_TRANSFERRED = "finished_transferred"  # prefill role: handed to a decode instance
    FINISHED_REJECTED = "finished_rejected"  # slo policy: cannot meet its target; no compute

    @property
    def finished(self) -> bool:
        return self in _FINISHED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISHED = frozenset(s for s in RequestStatus if s.value.startswith("finished"))
_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
    RequestStatus.FINISHED_REJECTED: "rejected",
}

# What a token's logprobs report: "<stage>_<kind>". Stages: `raw`, the model's output (and a
# structured output's mask); `adjusted`, after penalties, logit_bias, bans, allowed_token_ids
# and custom processors: what a greedy request picks from; `processed`, after temperature and
# the top-k/top-p/min-p filters too: what a token is drawn from. Kinds: log-probabilities or
# the logits themselves. vLLM's four are the raw and processed ones.
LOGPROBS_MODES = tuple(f"{stage}_{kind}" for stage in ("adjusted", "raw", "processed")
                       for kind in ("logprobs", "logits"))


@dataclass
class SamplingParams:
    """How to sample and when to stop; validated on construction."""

    max_tokens: int = 16
    """Most output tokens to generate (finish reason `length`)."""
    temperature: float = 1.0
    """0 means greedy."""
    top_p: float = 1.0
    """Nucleus sampling mass, in (0, 1]."""
    top_k: int = 0
    """Keep the k most likely tokens; 0 or -1 disables."""
    min_p: float = 0.0
    """Drop tokens whose probability is below min_p times the top one."""
    seed: int | None = None
    """Per-request seed: the same seed gives the same tokens in any batch."""
    n: int = 1
    """Number of sequences; the request forks after its prompt is prefilled."""
    stop_token_ids: list[int] = field(default_factory=list)
    """Token ids that end the request (finish reason `stop`), even with ignore_eos."""
    ignore_eos: bool = False
    """Keep generating past the model's end tokens (EOS, and the end-of-turn tokens its
    config lists); stop_token_ids still end it."""
    stop: list[str] = field(default_factory=list)
    """Strings that end the output (finish reason `stop`); the detokenizer finds them and
    they are not included in the text, nor is a stop token's (EOS, stop_token_ids)."""
    include_stop_str_in_output: bool = False
    """Keep the stop string, or the stop token's text, that ended the output (vLLM's)."""
    skip_special_tokens: bool = True
    """Leave special tokens' text (e.g. `<|im_end|>`) out of the output text."""
    priority: int = 0
    """Lower runs first under the `priority` policy."""
    background: bool = False
    """Work that yields to the rest (a Batch API line): admitted after every other waiting
    request, and while another's prompt waits or prefills, its decodes sit out the steps
    that prefill one."""
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None
    """Return this many top alternatives' log-probabilities per token."""
    prompt_logprobs: int | None = None
    """Return, for every prompt token after the first, its log-probability given the tokens
    before it and this many top alternatives: the raw model distribution (no temperature,
    penalties or bias), as vLLM's `prompt_logprobs`. Such a request reads no cached prefix
    blocks (tokens read from the cache have no logits); it still publishes its own."""
    embed: int | None = None
    """Return the prompt's embedding (the model's pooling of its final hidden states) with
    the first token: its first `embed` dimensions, or all of them with 0. Such a request
    reads no cached prefix blocks, as with prompt logprobs."""
    score: bool = False
    """With `embed`: return the model's relevance score of the prompt (its score head over
    the pooled final hidden state; tidal.model.score_head) instead of the embedding, as a
    one-value vector."""
    trace: bool = False
    """Record the request's scheduler events with their wall times (queued, admitted, each
    prefill chunk, preempted) and hand them over with its outputs (`RequestOutput.events`),
    for a trace span."""
    min_tokens: int = 0
    """Stop tokens (EOS, stop_token_ids) cannot be sampled before this many output tokens."""
    logit_bias: dict[int, float] = field(default_factory=dict)
    """Token id -> a bias in [-100, 100] added to its logit before sampling (OpenAI's
    logit_bias): -100 all but bans the token, 100 all but forces it. The ids must be in the
    model's vocabulary, which the engine checks when the request is added."""

    allowed_token_ids: list[int] | None = None
    """Only these token ids may be sampled (vLLM's allowed_token_ids): every other logit is
    masked out; None: any. The ids must be in the model's vocabulary, as logit_bias's."""
    bad_words: list[str] = field(default_factory=list)
    """Words the output must not hold (vLLM's bad_words): a word's last token is masked out
    where the output ends with the tokens before it (a one-token word: always)."""
    bad_words_token_ids: list[list[int]] = field(default_factory=list)
    """bad_words as token sequences (Tokenizer.bad_word_ids), set by the tokenizer's owner:
    the offline engine or the server's frontend."""
    cache_salt: str | None = None
    """Salts the request's prefix-cache blocks, and their keys in the tiers below the pool
    (vLLM's cache_salt): only requests of the same salt share them, so a tenant cannot learn
    from another's hit times what its prompts held. None: unsalted."""
    prediction: list[int] | None = None
    """Tokens the output is expected to repeat (OpenAI's predicted outputs): where the
    engine speculates (ngram or suffix), its guesses come from them first. The output is
    what it would be without them."""
    logprobs_mode: str | None = None
    """What `logprobs` report (LOGPROBS_MODES); None: the engine's `logprobs_mode`."""
    extra_args: dict[str, Any] | None = None
    """Arguments for the engine's custom logits processors (vLLM's extra_args; the API's
    vllm_xargs): each processor reads the keys it knows. None: none."""

    structured: tuple[str, str] | None = None
    """Constrain the output: (kind, spec) with kind `json` (a JSON schema, as JSON text),
    `regex`, `choice` (a JSON list of strings) or `grammar` (Lark / EBNF)."""

    lora: str | None = None
    """The LoRA adapter that serves this request, by name; None: the base model. Its
    prefix-cache blocks are its own: the same prompt under another adapter is no hit."""

    ttft_slo_ms: float | None = None
    """Time-to-first-token target in ms, from arrival (policy `slo`; None: the scheduler's
    default, if any)."""
    tpot_slo_ms: float | None = None
    """Target time per output token in ms (policy `slo`; None: the scheduler's default)."""

    def __post_init__(self) -> None:
        checks = [
            (self.max_tokens >= 1, f"max_tokens must be at least 1, got {self.max_tokens}"),
            (self.temperature >= 0, f"temperature must be >= 0, got {self.temperature}"),
            (0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}"),
            (self.top_k >= -1, f"top_k must be -1, 0 or positive, got {self.top_k}"),
            (0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p}"),
            (self.n >= 1, f"n must be at least 1, got {self.n}"),
            (self.seed is None or -2**63 <= self.seed and self.seed + self.n <= 2**64,
             "seed must be in [-2**63, 2**64 - n]: each of n sequences seeds seed + i"),
            (self.repetition_penalty > 0, "repetition_penalty must be > 0"),
            (self.logprobs is None or self.logprobs >= 0, "logprobs must be >= 0"),
            (self.prompt_logprobs is None or self.prompt_logprobs >= 0,
             "prompt_logprobs must be >= 0"),
            (0 <= self.min_tokens <= self.max_tokens, "min_tokens must be in [0, max_tokens]"),
            (self.embed is None or self.embed >= 0, "embed must be >= 0"),
            (not self.score or self.embed is not None, "score needs embed"),
            (self.ttft_slo_ms is None or self.ttft_slo_ms > 0, "ttft_slo_ms must be > 0"),
            (self.lora is None or (isinstance(self.lora, str) and self.lora != ""),
             "lora must be an adapter's name"),
            (self.tpot_slo_ms is None or self.tpot_slo_ms > 0, "tpot_slo_ms must be > 0"),
            (self.allowed_token_ids is None or len(self.allowed_token_ids) > 0,
             "allowed_token_ids must name at least one token (or be left out)"),
            (self.cache_salt is None or (isinstance(self.cache_salt, str)
                                         and self.cache_salt != ""),
             "cache_salt must be a non-empty string"),
            (self.logprobs_mode is None or self.logprobs_mode in LOGPROBS_MODES,
             f"logprobs_mode must be one of {', '.join(LOGPROBS_MODES)}"),
            (self.structured is None or (len(self.structured) == 2 and self.structured[0]
                                         in ("json", "regex", "choice", "grammar")),
             "structured must be (kind, spec) with kind json, regex, choice or grammar"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
        self.stop_token_ids = list(self.stop_token_ids)
        self.stop = [self.stop] if isinstance(self.stop, str) else list(self.stop)
        if any(not s for s in self.stop):
            raise ValueError("stop strings must not be empty")
        bias = {}
        for token, value in dict(self.logit_bias).items():
            if isinstance(token, bool) or not isinstance(token, int) or token < 0:
                raise ValueError(f"logit_bias keys must be token ids (ints >= 0), got {token!r}")
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or not -100 <= value <= 100:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {value!r} "
                                 f"for token {token}")
            bias[token] = float(value)
        self.logit_bias = bias
        self.bad_words = list(self.bad_words)
        if any(not isinstance(w, str) or not w.strip() for w in self.bad_words):
            raise ValueError("bad_words must be non-blank strings")
        self.bad_words_token_ids = [list(ids) for ids in self.bad_words_token_ids]
        if any(not ids for ids in self.bad_words_token_ids):
            raise ValueError("bad_words_token_ids must be non-empty token sequences")
        if self.allowed_token_ids is not None:
            if any(isinstance(t, bool) or not isinstance(t, int) or t < 0
                   for t in self.allowed_token_ids):
                raise ValueError("allowed_token_ids must be token ids (ints >= 0)")
            self.allowed_token_ids = sorted(set(self.allowed_token_ids))
        if self.structured is not None:
            self.structured = (str(self.structured[0]), str(self.structured[1]))
        if self.prediction is not None:
            self.prediction = list(self.prediction)
            if any(isinstance(t, bool) or not isinstance(t, int) or t < 0
                   for t in self.prediction):
                raise ValueError("prediction must be token ids (ints >= 0)")
        if self.extra_args is not None and (not isinstance(self.extra_args, dict) or any(
                not isinstance(k, str) for k in self.extra_args)):
            raise ValueError("extra_args must be a dict with string keys")

    def sibling(self, index: int) -> "SamplingParams":
        """Sequence `index` of an n > 1 request as a request of its own: n = 1, seeded
        seed + index (so an n-request seeded s is n requests seeded s ... s + n - 1)."""
        return replace(self, n=1, seed=None if self.seed is None else self.seed + index)


def token_slice(prompt: list[int], output: list[int], start: int, end: int) -> list[int]:
    """(prompt + output)[start:end] without concatenating the whole sequence."""
    n = len(prompt)
    if end <= n:
        return prompt[start:end]
    if start >= n:
        return output[start - n:end - n]
    return prompt[start:] + output[:end - n]


class Request:
    """One sequence: its prompt, generated tokens, KV progress and status.

    `num_computed_tokens` counts positions whose KV is written or scheduled to be written
    (it advances at schedule time, so an executor can run one step ahead). `num_in_flight`
    counts tokens scheduled to be sampled whose values have not arrived yet.
    """

    __slots__ = (
        "request_id", "prompt_token_ids", "sampling_params", "arrival_time", "eos_token_ids",
        "extra_key", "status", "output_token_ids", "num_computed_tokens", "prefill_target",
        "num_in_flight", "num_cached_tokens", "finish_message", "block_hashes", "block_tokens",
        "parent_id", "index", "enqueue_step", "remote_prefill", "fork_pending", "stop_ids",
        "out_limit", "max_tokens", "admitted", "num_guesses", "num_proposed", "spec_counts",
        "tier_keys", "tier_loading", "prompt_cached_tokens", "queue_seconds",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams | None = None,
        arrival_time: float = 0.0,
        eos_token_ids: tuple[int, ...] = (),
        extra_key: Hashable = None,
    ) -> None:
        if not prompt_token_ids:
            raise ValueError(f"request {request_id!r}: the prompt must hold at least one token")
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params or SamplingParams()
        self.arrival_time = arrival_time
        self.eos_token_ids = eos_token_ids  # the model's end tokens (EOS, end of turn)
        # salts prefix-cache hashes (the request's cache_salt; the adapter, whose KV differs)
        lora, salt = self.sampling_params.lora, self.sampling_params.cache_salt
        key = extra_key if salt is None else (extra_key, "salt", salt)
        self.extra_key = key if lora is None else (key, "lora", lora)
        self.status = RequestStatus.WAITING
        self.output_token_ids: list[int] = []
        self.num_computed_tokens = 0
        self.prefill_target = 0  # tokens to prefill before decoding; set at each admission
        self.num_in_flight = 0
        self.num_cached_tokens = 0  # prefix-cache hit at the last admission
        # of its prompt, those found cached at its first admission (usage's cached_tokens; a
        # readmission after preemption finds its own blocks)
        self.prompt_cached_tokens = 0
        self.queue_seconds = 0.0  # from its arrival to its first admission
        self.finish_message: str | None = None
        self.block_hashes: list[int] = []  # chain hashes of full blocks, grown lazily
        self.block_tokens: list[tuple[int, ...]] = []  # those blocks' token ids, hashed once
        self.tier_keys: list[bytes] = []  # their keys in the tier below the pool, grown lazily
        # the keys it loads from that tier now; None: it never did, [] once it has (once only)
        self.tier_loading: list[bytes] | None = None
        self.parent_id: str | None = None
        self.index = 0  # which of an n>1 request's sequences: set by fork()
        self.enqueue_step = 0
        self.admitted = False  # ever given blocks here (a retracted one is waiting again)
        self.remote_prefill = False  # decode role: KV comes from a prefill instance
        self.fork_pending = self.sampling_params.n > 1  # forks once its prompt is done
        self.stop_ids: frozenset[int] = frozenset()  # set by prepare_limits()
        self.max_tokens = self.sampling_params.max_tokens
        self.out_limit = self.max_tokens
        # Speculative decoding: guesses scheduled and not yet verified, guesses the
        # executor's proposer holds for the next step, and by that proposal length, the
        # decayed counts [accepted guesses, verifications that ended in a rejected one].
        self.num_guesses = 0
        self.num_proposed = 0
        self.spec_counts: dict[int, list[float]] = {}

    def prepare_limits(self, max_model_len: int) -> None:
        """Precompute the stop checks the per-step hot path runs: the token ids that stop
        this request, and how many output tokens it may have."""
        sp = self.sampling_params
        stops = set(sp.stop_token_ids)
        if not sp.ignore_eos:
            stops.update(self.eos_token_ids)
        self.stop_ids = frozenset(stops)
        self.out_limit = min(sp.max_tokens, max_model_len - len(self.prompt_token_ids))

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_slice(self, start: int, end: int) -> list[int]:
        """all_token_ids[start:end] without concatenating the whole sequence."""
        return token_slice(self.prompt_token_ids, self.output_token_ids, start, end)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def reads_prefix_cache(self) -> bool:
        """Whether admission may take cached prefix blocks: not while prompt logprobs or an
        embedding are owed (they come with the first output token, so a request with output
        has them)."""
        p = self.sampling_params
        return (p.prompt_logprobs is None and p.embed is None) or bool(self.output_token_ids)

    @property
    def lora(self) -> str | None:
        """The adapter serving this request (None: the base model)."""
        return self.sampling_params.lora

    @property
    def is_prefilling(self) -> bool:
        return self.num_computed_tokens < self.prefill_target

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    @property
    def finish_reason(self) -> str | None:
        return self.status.finish_reason

    def admit(self, num_cached: int, now: float) -> None:
        """Given blocks here at `now`, its first `num_cached` tokens found in the prefix
        cache: it prefills the rest. Its first admission's hit and wait are what it reports."""
        if not self.admitted:
            self.prompt_cached_tokens = min(num_cached, self.num_prompt_tokens)
            self.queue_seconds = max(0.0, now - self.arrival_time)
        self.num_computed_tokens = self.num_cached_tokens = num_cached
        self.admitted = True
        self.prefill_target = self.num_tokens

    def fork(self, index: int) -> "Request":
        """A sibling for n>1 sampling: same prompt and limits, n=1, no output yet."""
        child = Request(f"{self.request_id}-{index}", self.prompt_token_ids,
                        self.sampling_params.sibling(index),
                        self.arrival_time, self.eos_token_ids)
        child.extra_key = self.extra_key  # salted already
        child.parent_id, child.index = self.request_id, index
        child.stop_ids, child.out_limit = self.stop_ids, self.out_limit
        return child

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, {self.status.name}, prompt={self.num_prompt_tokens}, "
                f"out={len(self.output_token_ids)}, computed={self.num_computed_tokens})")


def ready_to_decode(decoding: list[Request], in_flight: int = 1) -> list[Request]:
    """Those that may still grow whose next position's token is known or in flight (an
    executor one step ahead may already hold a request's last token). With `in_flight`
    steps held by the executor at once (pipeline stages), the token must be known, and a
    step takes its share of `decoding`, so that each step in flight has some."""
    ahead = in_flight == 1
    ready = [r for r in decoding
             if (g := len(r.output_token_ids) + r.num_in_flight) < r.out_limit
             and r.num_computed_tokens < len(r.prompt_token_ids) + (
                 g if ahead else len(r.output_token_ids))]
    return ready if ahead else ready[:-(-len(decoding) // in_flight)]
