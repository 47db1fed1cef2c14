"""Token outputs -> text: per-sequence incremental detokenization, stop strings, and the
mapping of n>1 siblings back to the request the caller submitted. Used by the in-process
`Engine` and by the server's frontend alike."""

from __future__ import annotations

from dataclasses import dataclass, field

from tidal.core import RequestOutput, SamplingParams
from tidal.engine.detokenizer import IncrementalDetokenizer
from tidal.engine.outputs import StepUpdate


@dataclass
class _Request:
    """A tracked request: its params, every sequence it started (by id: its index), how many
    have ended."""

    params: SamplingParams
    started: dict[str, int] = field(default_factory=dict)
    ended: int = 0


class OutputProcessor:
    """Tracks live sequences; `process()` turns a step's outputs into `StepUpdate`s and says
    which sequences met a stop string (the caller ends them in the core)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._seqs: dict[str, tuple[str, int, IncrementalDetokenizer]] = {}
        # a late token of a sibling that ended here (still running in the core) starts nothing
        self._roots: dict[str, _Request] = {}

    def track(self, request_id: str, params: SamplingParams) -> None:
        self._roots[request_id] = _Request(params)
        self._add(request_id, request_id, 0)

    def _add(self, seq_id: str, root: str, index: int) -> None:
        req = self._roots[root]
        req.started[seq_id] = index
        p = req.params
        self._seqs[seq_id] = (root, index, IncrementalDetokenizer(
            self.tokenizer, p.stop, p.skip_special_tokens, p.include_stop_str_in_output))

    def forget(self, request_id: str) -> None:
        """Drop a request and its siblings (aborted); later outputs for them are ignored."""
        req = self._roots.pop(request_id, None)
        for seq in req.started if req is not None else ():
            self._seqs.pop(seq, None)

    def _ended(self, seq_id: str, root: str) -> None:
        del self._seqs[seq_id]
        req = self._roots[root]
        req.ended += 1
        if req.ended >= req.params.n:  # every sibling ended: nothing more can come
            del self._roots[root]

    def end(self, request_id: str, reason: str, message: str | None) -> list[StepUpdate]:
        """End a request's unfinished sequences here, then forget it: each one's last update
        carries the text its detokenizer held back, and a sibling not forked yet ends empty
        (an abort that answers with what was generated)."""
        req = self._roots.get(request_id)
        if req is None:
            return []
        index_of = {i: seq for seq, i in req.started.items()}
        updates = []
        for index in range(req.params.n):
            seq = index_of.get(index)
            if seq is not None and seq not in self._seqs:
                continue  # ended already
            text = self._seqs[seq][2].flush() if seq is not None else ""
            updates.append(StepUpdate(seq or f"{request_id}-{index}", request_id, index, [],
                                      text, True, reason, message))
        self.forget(request_id)
        return updates

    def process(self, outputs: list[RequestOutput]) -> tuple[list[StepUpdate], list[str]]:
        """Each output's logprobs (and prompt logprobs, on index 0's first token) go on its
        update as the core attached them."""
        updates, stopped = [], []
        for o in outputs:
            if o.request_id not in self._seqs:
                root = self._roots.get(o.parent_id) if o.parent_id is not None else None
                if root is None or o.request_id in root.started:
                    continue  # a late token of a forgotten or already ended sequence
                self._add(o.request_id, o.parent_id, o.index)
            root, index, detok = self._seqs[o.request_id]
            finished, reason, message = o.finished, o.finish_reason, o.finish_message
            # the core ends a request with `stop` at a stop token (EOS, stop_token_ids),
            # whose text is left out as a stop string's is
            ids = (o.new_token_ids[:-1] if finished and reason == "stop"
                   and not detok.include_stop else o.new_token_ids)
            text = detok.add(ids)
            if detok.stopped and not finished:
                stopped.append(o.request_id)
                finished, reason = True, "stop"
            if finished:
                text += detok.flush()
                self._ended(o.request_id, root)
            updates.append(StepUpdate(o.request_id, root, index, o.new_token_ids, text,
                                      finished, reason, message, o.logprobs,
                                      o.prompt_logprobs, o.embedding,
                                      detok.stop_string if finished else None, o.events,
                                      o.cached_tokens, o.queue_seconds))
        return updates, stopped
