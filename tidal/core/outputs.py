"""Plain data passed between the scheduler and whatever executes its plan.

msgspec Structs: built in C (several times cheaper than a NamedTuple on the per-request hot
path), untracked by the garbage collector, and sent over the engine's IPC as they are.
"""

from __future__ import annotations

import msgspec

from tidal.core.request import Request, SamplingParams


class ScheduledRequest(msgspec.Struct, array_like=True, gc=False):
    """One request's share of a step."""

    request_id: str
    num_new_tokens: int
    num_computed_tokens: int  # tokens already in the KV cache before this step
    block_ids: list[int]  # the whole block table after this step's allocation
    samples: bool  # the step ends at the request's last known token, so it samples one
    is_prefill: bool  # prompt tokens (a chunk, or a recompute); else one decode token


class NewRequest(msgspec.Struct, gc=False):
    """What an executor needs to know of a request, sent with the first step that schedules
    it (again, after a retraction); later steps send only its ScheduledRequest. The executor
    appends the tokens it samples itself."""

    request_id: str
    prompt_token_ids: list[int]  # shared with the scheduler: read, never modified
    output_token_ids: list[int]  # known so far: before a retraction, a fork's first token
    sampling_params: SamplingParams
    stop_token_ids: list[int]  # EOS (unless ignore_eos) and stop_token_ids
    num_samples: int  # tokens its next sample draws: n where an n>1 request has yet to fork


def new_request(r: Request) -> NewRequest:
    """What the executor learns of `r` when a step first schedules it (again)."""
    p = r.sampling_params
    return NewRequest(r.request_id, r.prompt_token_ids, list(r.output_token_ids), p,
                      sorted(r.stop_ids), p.n if r.fork_pending else 1)


class KVLoad(msgspec.Struct, array_like=True, gc=False):
    """Blocks of one request to read from the tier below the pool, in order. `inline`: read
    before the step's forward pass, which computes the rest of the request's prompt (a
    request whose load fails is left out of that pass); otherwise read beside the step,
    before its result is returned (no forward pass of the step reads them)."""

    request_id: str
    block_ids: list[int]
    keys: list[bytes]
    inline: bool = False


class SchedulerOutput(msgspec.Struct):
    """The plan of one step. An executor forgets `finished_ids`, then learns
    `new_requests`, then runs `scheduled` (an id may end and be reused in one plan)."""

    step: int
    kind: str  # "prefill", "decode", "mixed" or "idle"
    scheduled: list[ScheduledRequest] = msgspec.field(default_factory=list)
    new_requests: list[NewRequest] = msgspec.field(default_factory=list)
    preempted_ids: list[str] = msgspec.field(default_factory=list)
    finished_ids: list[str] = msgspec.field(default_factory=list)  # since the last plan
    block_copies: list[tuple[int, int]] = msgspec.field(default_factory=list)  # (src, dst)
    transfer_ids: list[str] = msgspec.field(default_factory=list)  # KV moves after this step
    # the tier below the pool: blocks to copy out before this step's forward pass (block id,
    # key), and blocks to read in during it
    kv_stores: list[tuple[int, bytes]] = msgspec.field(default_factory=list)
    kv_loads: list[KVLoad] = msgspec.field(default_factory=list)
    # speculative decoding: report the proposers' guesses for the requests this step
    # samples (the planner may use them next step)
    propose: bool = False
    # a step computing a background request's prompt chunk, which the executor may stop
    # between layers once a live request arrives (tidal/core/step_cut.py)
    cuttable: bool = False

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


# The logprob a masked token reports (a constraint, a ban, allowed_token_ids): vLLM's floor,
# as JSON has no -inf.
MASKED_LOGPROB = -9999.0


class TokenLogprob(msgspec.Struct, array_like=True, gc=False):
    """A sampled token's log-probability and the top alternatives, as (token, logprob)
    sorted likeliest first."""

    logprob: float
    top: list[tuple[int, float]]


class PromptLogprob(TokenLogprob, array_like=True, gc=False):
    """A prompt token's log-probability given the tokens before it, the top alternatives,
    and its rank in the whole distribution (1: the likeliest), as vLLM reports it."""

    rank: int


class ModelOutput(msgspec.Struct):
    """What the executor returns for one step.

    `sampled` maps a request id to its sampled token (n tokens on the step where a request
    with n>1 finishes its prompt; for a decode entry of 1 + k positions, its accepted
    guesses then the model's own token: 1 to k + 1 tokens). `preempted_ack` names preempted requests whose slot the
    executor has drained: a typed acknowledgement, never a magic token id.
    """

    sampled: dict[str, list[int]] = msgspec.field(default_factory=dict)
    preempted_ack: list[str] = msgspec.field(default_factory=list)
    # For requests that asked for logprobs: one entry per sampled token (an n>1 request's
    # row holds its siblings' first tokens too). The scheduler ignores it; the engine core
    # moves each entry onto its RequestOutput.
    logprobs: dict[str, list[TokenLogprob]] = msgspec.field(default_factory=dict)
    # For requests that asked for prompt logprobs, on the step that samples their first
    # token: one entry per prompt position, None for position 0 (nothing predicts it).
    prompt_logprobs: dict[str, list[PromptLogprob | None]] = msgspec.field(
        default_factory=dict)
    # For requests that asked for an embedding, on the step that samples their first token.
    embeddings: dict[str, list[float]] = msgspec.field(default_factory=dict)
    # Speculative decoding: guesses verified per decode entry that had room for some (the
    # proposer may hold fewer than the entry's k), and the guesses the proposer holds for
    # each request that sampled, ready for its next step.
    drafted: dict[str, int] = msgspec.field(default_factory=dict)
    proposed: dict[str, int] = msgspec.field(default_factory=dict)
    # Requests the executor cannot go on with (e.g. an output constraint that failed while
    # decoding), and why: they end with `error` before this step's tokens reach them.
    failed: dict[str, str] = msgspec.field(default_factory=dict)
    # The step's loads from the tier below the pool: each request's leading blocks that
    # loaded whole (the next one failed, if fewer than asked), and the seconds they took.
    kv_loaded: dict[str, int] = msgspec.field(default_factory=dict)
    kv_load_seconds: float = 0.0
    # the step was cut short (a `cuttable` plan, a live request arrived): nothing sampled
    cut: bool = False


class RequestOutput(msgspec.Struct, array_like=True, gc=False):
    """New tokens of one request after a step, whether it finished, and the logprobs of
    those tokens (and of its prompt, with its first token) where it asked for them."""

    request_id: str
    new_token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None
    finish_message: str | None = None
    parent_id: str | None = None  # set on the siblings an n>1 request forks into
    index: int = 0  # which of an n>1 request's sequences (the parent is 0)
    kv_transfer: bool = False  # prefill role: the request left for its decode instance
    logprobs: list[TokenLogprob] | None = None  # one per new token; None: not asked for
    prompt_logprobs: list[PromptLogprob | None] | None = None  # whole, with the first token
    embedding: list[float] | None = None  # with the first token, where asked for
    # SamplingParams.trace: the scheduler's events since its last output, each (name, unix
    # seconds, attributes)
    events: list[tuple[str, float, dict[str, int]]] | None = None
    # the prompt's tokens found in the prefix cache (or a tier below it) at its first
    # admission, not computed for it (an n>1 request's: its index 0's)
    cached_tokens: int = 0
    queue_seconds: float = 0.0  # from its arrival to its first admission (vLLM's queue time)
