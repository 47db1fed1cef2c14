"""`tidal run-batch -i in.jsonl -o out.jsonl` (vLLM's run-batch): the lines of an OpenAI Batch
API input file sent to the server's own app in this process (its lifespan runs the engine
cores), as many at once as --max-pending takes, so that the engine batches them, and each
answer written as OpenAI's batch output writes it (`lines.py`), in the input's order."""

from __future__ import annotations

import asyncio
import json

import httpx

from tidal.server.batches.lines import answer


async def run_batch(app, source: str, target: str, in_flight: int) -> dict[str, int]:
    """Answer every line of `source` into `target`, at most `in_flight` at once (the
    server's --max-pending); the counts of lines, answered, failed."""
    with open(source, encoding="utf-8") as f:
        lines = [(n, text) for n, text in enumerate(f, 1) if text.strip()]
    transport = httpx.ASGITransport(app=app)
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=transport, base_url="http://batch",
                                     timeout=None) as http:
            room = asyncio.Semaphore(max(1, in_flight))

            async def one(text: str, number: int) -> dict:
                async with room:
                    return await answer(http, text, number)

            answers = await asyncio.gather(*(one(text, n) for n, text in lines))
    with open(target, "w", encoding="utf-8") as f:
        for a in answers:
            f.write(json.dumps(a) + "\n")
    failed = sum(a["error"] is not None for a in answers)
    return {"lines": len(answers), "ok": len(answers) - failed, "failed": failed}
