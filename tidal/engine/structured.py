"""Structured outputs: constrain a request's tokens to a JSON schema, a regex, a choice of
strings or a Lark grammar, with llguidance (Rust, no torch: it computes each step's token
mask on the CPU and releases the GIL meanwhile).

`Grammars` compiles and checks a `SamplingParams.structured` spec against the model's
tokenizer, and caches the compiled matchers; `Matchers` keeps one matcher per sequence in
the model runner, a copy of the compiled one. A served engine core compiles a request's
constraint on a worker thread before the request reaches its scheduler
(`tidal/runtime/core_process.py`), so a slow grammar never stalls the step loop. Each step the
masks of the sampling rows are computed on a worker thread while the forward pass runs,
then applied to the logits as a bitmask; the sampled tokens advance the matchers. A
sequence whose grammar is complete may only end (its stop tokens).

With speculative decoding, guesses the grammar forbids are cut before verification (`cut`),
and a verification's row j is masked by the matcher's state after the first j guesses: the
matcher walks through the guesses and rolls back, then advances through the tokens the
verification emits.
"""

from __future__ import annotations

import json
import threading
from concurrent.futures import Future, ThreadPoolExecutor

from typing import TYPE_CHECKING, Callable

import numpy as np

if TYPE_CHECKING:
    import torch

KINDS = ("json", "regex", "choice", "grammar")  # SamplingParams.structured[0]
# One grammar row holds at most 2000 items (llguidance's max_items_in_row); n choices make
# n + 1, which fail only once decoding reaches them
MAX_CHOICES = 1999
CACHED = 64  # compiled constraints kept (a workload reuses a few schemas)
# The grammar engine's work budgets, a tenth of llguidance's defaults: a step's mask then
# costs at most ~2 ms of lexer work and a lexer ~25k states, so one request's constraint
# cannot stall a step; schemas, regexes and grammars of real use stay well inside, and one
# past them fails (a 400 when its first mask does, else an error while decoding).
LIMITS = {"initial_lexer_fuel": 100_000, "step_lexer_fuel": 20_000, "max_lexer_states": 25_000}
PROBE_STEPS = 4  # tokens a new constraint is walked ahead at compilation (`_probe`)
_BITS = np.arange(32, dtype=np.int32)
# tidal's kind -> llguidance's grammar_from format
_FORMATS = {"json": "json", "regex": "regex", "choice": "choice", "grammar": "lark"}


def _compact(schema_text: str) -> str:
    """JSON without free whitespace between tokens (as OpenAI's outputs are): a small model
    given the choice fills the output with newlines. A schema's own x-guidance wins."""
    schema = json.loads(schema_text)
    if isinstance(schema, dict) and "x-guidance" not in schema:
        schema = {**schema, "x-guidance": {"whitespace_flexible": False}}
    return json.dumps(schema)


class Grammars:
    """The model's tokenizer as llguidance sees it (built once, ~0.3 s): compilation of
    constraints, and each token's bytes (for logprobs)."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_id: int | None) -> None:
        import llguidance
        import llguidance.numpy as lln  # the frontend compiles constraints without torch

        self._ll, self._lln = llguidance, lln
        self.tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size,
                                                eos_token=eos_token_id)
        self.vocab_size = vocab_size
        # compiled matchers at their start, by (kind, spec): a sequence's is a copy, so a
        # constraint compiled off the step loop (`compile`) costs the loop nothing
        self._compiled: dict[tuple[str, str], object] = {}
        self._lock = threading.Lock()
        self.limits = llguidance.LLParserLimits(**LIMITS)
        self._token_lengths: np.ndarray | None = None

    def grammar(self, kind: str, spec: str) -> str:
        """llguidance's grammar for a spec; ValueError naming what is wrong with it."""
        try:
            choices = len(json.loads(spec)) if kind == "choice" else None
            if choices == 0:
                raise ValueError("the choice list is empty")
            if choices is not None and choices > MAX_CHOICES:
                raise ValueError(f"{choices} choices; llguidance's parser takes at most "
                                 f"{MAX_CHOICES}")
            if kind == "json":
                spec = _compact(spec)
            grammar = self._ll.grammar_from(_FORMATS[kind], spec)
        except (ValueError, TypeError) as exc:
            raise ValueError(f"the {kind} constraint does not compile: {exc}") from exc
        error = self._ll.LLMatcher.validate_grammar(grammar, self.tokenizer)
        if error:  # its first line and the line saying what is wrong
            lines = [ln.strip() for ln in error.strip().splitlines()]
            why = [ln for ln in lines[1:] if ln.startswith("error")]
            raise ValueError(f"the {kind} constraint does not compile: "
                             + " ".join(lines[:1] + why[:1]))
        return grammar

    def token_bytes(self, token: int) -> bytes:
        """A token's own bytes (a partial UTF-8 character stays partial); a special token's
        text."""
        if self.tokenizer.is_special_token(token):
            return self.tokenizer.decode_str([token]).encode()
        return self.tokenizer.decode_bytes([token])

    def compile(self, kind: str, spec: str):
        """Compile a constraint and compute its first mask (the costly part: the lexer
        built over the vocabulary, which the sequences' copies then share), into the cache
        of the last CACHED; from any thread. Returns the compiled matcher (copy it: it is
        shared). ValueError naming what is wrong, including a grammar that fails on its
        first mask (e.g. a schema that only refers to itself)."""
        key = (kind, spec)
        with self._lock:
            if key in self._compiled:
                return self._compiled[key]
        m = self._ll.LLMatcher(self.tokenizer, self.grammar(kind, spec), limits=self.limits)
        self._lln.fill_next_token_bitmask(m, self._lln.allocate_token_bitmask(1, self.vocab_size))
        if m.is_error():
            raise ValueError(f"the {kind} constraint does not compile: {error_line(m)}")
        failure = self._probe(m.deep_copy())
        if failure:
            raise ValueError(f"the {kind} constraint cannot be followed: {failure} (its "
                             "repetitions grow past the grammar engine's limits)")
        with self._lock:
            self._compiled[key] = m
            while len(self._compiled) > CACHED:
                del self._compiled[next(iter(self._compiled))]  # the oldest
        return m

    def _probe(self, m) -> str | None:
        """Walk a copy of a fresh matcher PROBE_STEPS tokens ahead, the longest allowed one
        each time: a lexer or parser that outgrows the engine's budgets (nested counted
        repetitions, a forced output of millions of tokens) fails on its first steps, so
        it is refused before admission rather than ending in an error mid-answer."""
        bitmask = self._lln.allocate_token_bitmask(1, self.vocab_size)
        for _ in range(PROBE_STEPS):
            self._lln.fill_next_token_bitmask(m, bitmask, 0)
            if m.is_error():
                return error_line(m)
            if m.is_stopped():
                return None
            allowed = (bitmask[0, :, None] >> _BITS) & 1  # words x 32 bits: a token each
            lengths = np.where(allowed.reshape(-1)[:self.vocab_size].astype(bool),
                               self._lengths(), -1)
            if int(lengths.max()) <= 0:  # nothing but a stop token may follow
                return None
            m.consume_token(int(lengths.argmax()))
        return error_line(m) if m.is_error() else None

    def _lengths(self) -> np.ndarray:
        """Each token's byte length; 0 for special tokens (the probe never picks them)."""
        if self._token_lengths is None:
            self._token_lengths = np.array(
                [0 if self.tokenizer.is_special_token(t) else len(self.token_bytes(t))
                 for t in range(self.vocab_size)])
        return self._token_lengths

    def matcher(self, kind: str, spec: str, consumed: list[int]):
        """A matcher at the state after `consumed` (a resumed or forked sequence's tokens),
        copied from the compiled one (compiled now if it is not cached)."""
        m = self.compile(kind, spec).deep_copy()  # compiled ahead, or now (offline)
        if consumed and not m.consume_tokens(consumed):
            raise ValueError(f"the tokens so far do not match the {kind} constraint")
        return m


def error_line(matcher) -> str:
    """A failed matcher's error, its first line (llguidance's next lines dump its state)."""
    return (matcher.get_error().strip().splitlines() or ["unknown error"])[0]


def penalty(words: torch.Tensor, width: int) -> torch.Tensor:
    """Bitmask rows as `width` float32 each: 0 where allowed, -inf where not (tokens past
    the mask's end too), to add to the logits. Eager and integer-only (llguidance.torch's
    torch.compile'd kernel costs seconds of compiling on a server's first constrained
    request; a boolean masked_fill is several times slower than this add on CPU)."""
    import torch

    bits = (unpacked_bits(words) if words.device.type == "cpu"
            else shifted_bits(words))[:, :width].to(torch.int32)
    if bits.shape[1] < width:
        bits = torch.cat([bits, bits.new_zeros(len(bits), width - bits.shape[1])], 1)
    # allowed: 1 - 1 = 0 -> +0.0; not: -1 (all ones) & -inf's bits -> -inf
    return ((bits - 1) & _NEG_INF_BITS).view(torch.float32)


_NEG_INF_BITS = -(1 << 23)  # 0xff800000 as an int32: float32 -inf


def unpacked_bits(words: torch.Tensor) -> torch.Tensor:
    """A CPU bitmask's bits, one byte each (numpy unpacks them in C; the words'
    little-endian bytes hold the bits in token order)."""
    import torch

    return torch.from_numpy(np.unpackbits(words.numpy().view(np.uint8), axis=1,
                                          bitorder="little"))


def shifted_bits(words: torch.Tensor) -> torch.Tensor:
    """The same bits on any device, by shifts."""
    import torch

    shifts = torch.arange(32, dtype=torch.int32, device=words.device)
    return ((words.unsqueeze(-1) >> shifts) & 1).flatten(1)


class Matchers:
    """The constrained sequences of a model runner, by request id. `cpu_bitmask`: the C++
    extension's one-pass mask for CPU logits (else the eager `penalty`)."""

    def __init__(self, grammars: Grammars,
                 cpu_bitmask: Callable[[torch.Tensor, torch.Tensor], None] | None = None) -> None:
        self.grammars, self._cpu_bitmask = grammars, cpu_bitmask
        self.by_id: dict[str, object] = {}
        self._pool = ThreadPoolExecutor(1, "tidal-grammar")

    def add(self, rid: str, kind: str, spec: str, consumed: list[int]) -> str | None:
        """Start a sequence's matcher at the state after `consumed`; what is wrong, if it
        cannot be."""
        try:
            self.by_id[rid] = self.grammars.matcher(kind, spec, consumed)
        except ValueError as exc:
            return str(exc)
        return None

    def failure(self, rid: str) -> str | None:
        """Why a sequence's grammar failed while it decoded (a limit of the grammar engine
        hit, e.g. too many lexer states), or None while it holds."""
        m = self.by_id.get(rid)
        if m is None or not m.is_error():
            return None
        return f"the output constraint failed while decoding: {error_line(m)}"

    def drop(self, rid: str) -> None:
        self.by_id.pop(rid, None)

    def cut(self, rid: str, guesses: list[int]) -> list[int]:
        """The guesses up to the first one the sequence's grammar forbids."""
        m = self.by_id.get(rid)
        return guesses[:m.validate_tokens(guesses)] if m is not None and guesses else guesses

    def start(self, rows: list[tuple[str, list[int]]]) -> Future | None:
        """Begin computing the masks of these sampling entries, (id, guesses) each: one row
        per position, on the worker thread; None when none of them is constrained."""
        rows = [(r, g, self.by_id[r]) for r, g in rows if r in self.by_id]
        return self._pool.submit(self._fill, rows) if rows else None

    def _fill(self, rows: list) -> tuple[dict[str, int], list[bool], torch.Tensor]:
        """The bitmask rows (an entry's first row by id) and whether the grammar accepts at
        each: after row j's j guesses, consumed and then rolled back."""
        size = sum(1 + len(g) for _, g, _ in rows)
        import torch

        # llguidance's layout: token t is bit t % 32 of word t // 32 (1: allowed)
        bitmask = torch.full((size, (self.grammars.vocab_size + 31) // 32), -1,
                             dtype=torch.int32)
        first, accepting, i = {}, [], 0
        for rid, guesses, m in rows:
            first[rid] = i
            for j in range(len(guesses) + 1):
                m.unsafe_compute_mask_ptr(bitmask[i].data_ptr(), bitmask.shape[1] * 4)
                accepting.append(m.is_accepting())
                i += 1
                if j < len(guesses):
                    m.consume_token(guesses[j])
            if guesses:
                m.rollback(len(guesses))
        return first, accepting, bitmask

    def apply(self, pending: Future, logits: torch.Tensor, rids: list[str],
              stop_ids: list[list[int]]) -> None:
        """In place: the constrained rows' disallowed tokens to -inf (rids: each logits
        row's sequence, a verification's rows in a run). A row whose grammar accepts may
        also end with any of its stop tokens."""
        first, accepting, bitmask = pending.result()
        rows, masks, j = [], [], 0
        for i, r in enumerate(rids):
            j = j + 1 if i and rids[i - 1] == r else 0
            if r in first:
                rows.append(i)
                masks.append(first[r] + j)
        sub, words = logits[rows], bitmask[masks]
        if self._cpu_bitmask is not None and sub.device.type == "cpu":
            self._cpu_bitmask(sub, words)
        else:
            sub.add_(penalty(words.to(logits.device), sub.shape[1]))
        for k, (i, b) in enumerate(zip(rows, masks)):
            if stop_ids[i] and accepting[b]:
                sub[k, stop_ids[i]] = logits[i, stop_ids[i]]
        logits[rows] = sub

    def advance(self, rid: str, tokens: list[int]) -> None:
        m = self.by_id.get(rid)
        for token in tokens:
            if m is None or m.is_stopped():
                return
            m.consume_token(token)
