"""Token outputs -> text: per-sequence incremental detokenization, stop strings, and the
mapping of n>1 siblings back to the request the caller submitted. Used by the in-process
`Engine` and by the server's frontend alike."""

from __future__ import annotations

from tidal.core import RequestOutput, SamplingParams
from tidal.engine.detokenizer import IncrementalDetokenizer
from tidal.engine.outputs import StepUpdate


class OutputProcessor:
    """Tracks live sequences; `process()` turns a step's outputs into `StepUpdate`s and says
    which sequences met a stop string (the caller ends them in the core)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._seqs: dict[str, tuple[str, int, IncrementalDetokenizer]] = {}
        # per request: its params and the sequences that ended, so that a token of a
        # sibling ended here but still running in the core does not start it again
        self._roots: dict[str, tuple[SamplingParams, set[str]]] = {}

    def track(self, request_id: str, params: SamplingParams) -> None:
        self._roots[request_id] = (params, set())
        self._add(request_id, request_id, 0)

    def _add(self, seq_id: str, root: str, index: int) -> None:
        stop = self._roots[root][0].stop
        self._seqs[seq_id] = (root, index, IncrementalDetokenizer(self.tokenizer, stop))

    def forget(self, request_id: str) -> None:
        """Drop a request and its siblings (aborted); later outputs for them are ignored."""
        self._roots.pop(request_id, None)
        for seq in [s for s, v in self._seqs.items() if v[0] == request_id]:
            del self._seqs[seq]

    def _ended(self, seq_id: str, root: str) -> None:
        del self._seqs[seq_id]
        params, ended = self._roots[root]
        ended.add(seq_id)
        if len(ended) >= params.n:  # every sibling ended: nothing more can come
            del self._roots[root]

    def process(self, outputs: list[RequestOutput], logprobs: dict[str, list],
                ) -> tuple[list[StepUpdate], list[str]]:
        updates, stopped = [], []
        for o in outputs:
            if o.request_id not in self._seqs:
                root = self._roots.get(o.parent_id) if o.parent_id is not None else None
                if root is None or o.request_id in root[1]:
                    continue  # a late token of a forgotten or already ended sequence
                self._add(o.request_id, o.parent_id, int(o.request_id.rsplit("-", 1)[1]))
            root, index, detok = self._seqs[o.request_id]
            text = detok.add(o.new_token_ids)
            finished, reason, message = o.finished, o.finish_reason, o.finish_message
            if detok.stopped and not finished:
                stopped.append(o.request_id)
                finished, reason = True, "stop"
            if finished:
                text += detok.flush()
                self._ended(o.request_id, root)
            updates.append(StepUpdate(o.request_id, root, index, o.new_token_ids, text,
                                      finished, reason, message, logprobs.get(o.request_id)))
        return updates, stopped
