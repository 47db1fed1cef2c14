"""--stream-interval: a stream's updates gathered into chunks of that many tokens per
sequence. The first token of each sequence goes at once (time to first token is what a
user waits on), a sequence's ending flushes what it holds, and the latency metrics are
taken before, from the engine's own steps."""

from __future__ import annotations

from tidal.engine.outputs import StepUpdate
from tidal.server.openai.generation_bodies import Updates


async def every_n_tokens(updates: Updates, interval: int) -> Updates:
    """`updates` ((choice index, update) pairs) with each choice's updates merged until
    `interval` tokens since its last chunk, its first token or its end."""
    held: dict[int, StepUpdate] = {}
    sent: set[int] = set()  # choices whose first token went
    try:
        async for i, u in updates:
            if i in held:
                u = held.pop(i).then(u)
            if u.finished or i not in sent or len(u.new_token_ids) >= interval:
                sent.add(i)
                yield i, u
            else:
                held[i] = u
    finally:  # closed by the answer: the engine's updates end with it
        await updates.aclose()
