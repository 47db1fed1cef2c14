"""vLLM's `use_beam_search` on the server: the request's `n` is the beam width. Each step
sends every live beam of every prompt as a one-token request for its likeliest next
tokens (`tidal/engine/beam_search.py` keeps the best), and when every search is over its
answers go to the response body as one finished update each: chat, completions, streams
and usage read them as any answer's. A step's requests are ordinary engine requests: they
count in /metrics, and the prefix cache holds the blocks the beams share."""

from __future__ import annotations

import uuid
from typing import TYPE_CHECKING, Mapping

from tidal.engine.beam_search import BeamSearch, BeamSearches, step_params, stop_token_ids
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
    group = BeamSearches(prompts, [
        BeamSearch(p.n, p.max_tokens, stop_token_ids(p.stop_token_ids, f.end_tokens,
                                                     p.ignore_eos),
                   body.length_penalty) for p in base])
    return _search(f, body, headers, base, group)


async def _search(f: Frontend, body: GenerationRequest, headers: Mapping[str, str],
                  base: list, group: BeamSearches) -> Updates:
    cached = [0] * len(group.prompts)  # each prompt's hit at its first step: its admission
    first = True
    while group.live:
        asks = group.asks()
        params = [step_params(base[k], group.searches[k]) for k in group.owners]
        sub = await f.submit(asks, body, headers, params)
        tops: list = [[] for _ in asks]
        try:
            async for i, u in f.updates(sub):
                if u.finish_reason == "error":
                    raise APIError(u.finish_message or "generation failed", 500,
                                   "internal_error")
                if u.logprobs:
                    tops[i] = u.logprobs[0].top
                if first:
                    cached[group.owners[i]] = u.cached_tokens
        finally:
            await sub.end()
        first = False
        group.extend(tops)
    rid = uuid.uuid4().hex[:16]
    keep, skip = body.include_stop_str_in_output, body.skip_special_tokens
    for k, s in enumerate(group.searches):
        for j, beam in enumerate(s.best()):
            text = f.tokenizer.decode(beam.text_ids(keep), skip_special_tokens=skip)
            yield k * body.n + j, StepUpdate(
                f"{rid}-{k}-{j}", f"{rid}-{k}", j, beam.token_ids, text, True,
                beam.finish_reason, cached_tokens=cached[k])
