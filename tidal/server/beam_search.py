"""vLLM's `use_beam_search` on the server: the request's `n` is the beam width. Each step
sends every live beam of every prompt as a one-token request for its likeliest next
tokens (`tidal/engine/beam_search.py` keeps the best), and when every search is over its
answers go to the response body as one finished update each: chat, completions, streams
and usage read them as any answer's. A step's requests are ordinary engine requests: they
count in /metrics, and the prefix cache holds the blocks the beams share."""

from __future__ import annotations

import uuid
from typing import TYPE_CHECKING, Mapping

from tidal.engine.beam_search import BeamSearch, step_params, stop_token_ids
from tidal.engine.outputs import StepUpdate
from tidal.server.openai.generation_bodies import Updates
from tidal.server.openai.protocol import APIError, GenerationRequest

if TYPE_CHECKING:
    from tidal.server.frontend import Frontend


def beam_search_updates(f: Frontend, prompts: list[list[int]], body: GenerationRequest,
                        headers: Mapping[str, str]) -> Updates:
    """The searches' answers as (choice index, update); the request's fields are checked
    here, before any step (a 400 comes as a plain error, not inside a stream)."""
    base = f.sampling_params(prompts, body)
    eos = f.tokenizer.eos_token_id
    searches = [BeamSearch(p.n, p.max_tokens, stop_token_ids(p.stop_token_ids, eos,
                                                              p.ignore_eos),
                           body.length_penalty) for p in base]
    return _search(f, prompts, body, headers, base, searches)


async def _search(f: Frontend, prompts: list[list[int]], body: GenerationRequest,
                  headers: Mapping[str, str], base: list, searches: list[BeamSearch]) -> Updates:
    cached = [0] * len(prompts)  # each prompt's hit at its first step, its first admission
    first = True
    while any(s.live for s in searches):
        owner = [k for k, s in enumerate(searches) for _ in s.live]
        asks = [prompts[k] + b.token_ids for k, s in enumerate(searches) for b in s.live]
        params = [step_params(base[k], searches[k]) for k in owner]
        sub = await f.submit(asks, body, headers, params)
        tops: list = [None] * len(asks)
        try:
            async for i, u in f.updates(sub):
                if u.finish_reason == "error":
                    raise APIError(u.finish_message or "generation failed", 500,
                                   "internal_error")
                if u.logprobs:
                    tops[i] = u.logprobs[0].top
                if first:
                    cached[owner[i]] = u.cached_tokens
        finally:
            await sub.end()
        first = False
        for k, s in enumerate(searches):
            if s.live:
                s.extend([t or [] for t, o in zip(tops, owner) if o == k])
    rid = uuid.uuid4().hex[:16]
    keep, skip = body.include_stop_str_in_output, body.skip_special_tokens
    for k, s in enumerate(searches):
        for j, beam in enumerate(s.best()):
            text = f.tokenizer.decode(beam.text_ids(keep), skip_special_tokens=skip)
            yield k * body.n + j, StepUpdate(
                f"{rid}-{k}-{j}", f"{rid}-{k}", j, beam.token_ids, text, True,
                beam.finish_reason, cached_tokens=cached[k])
