"""`tidal run-batch -i in.jsonl -o out.jsonl` (vLLM's run-batch): the lines of an OpenAI Batch
API input file (`custom_id`, `method`, `url`, `body`) sent to the server's own app in this
process (its lifespan runs the engine cores), as many at once as --max-pending takes, so
that the engine batches them,
and each answer written as OpenAI's batch output writes it: `id`, `custom_id`, `response`
(`status_code`, `request_id`, `body`) and `error` (null, or the failure's code and
message), in the input's order."""

from __future__ import annotations

import asyncio
import json
import uuid

import httpx

URLS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses",
        "/v1/messages", "/v1/score", "/v1/rerank")


def _problem(line: dict) -> str | None:
    """Why a line cannot be sent (None: it can)."""
    if not isinstance(line, dict):
        return "a line must be a JSON object"
    if line.get("method", "POST") != "POST":
        return f"method must be POST, got {line.get('method')!r}"
    if line.get("url") not in URLS:
        return f"url must be one of {', '.join(URLS)}, got {line.get('url')!r}"
    if not isinstance(line.get("body"), dict):
        return "body must be an object"
    if line["body"].get("stream"):
        return "a batch line is answered whole: stream must be false"
    return None


def _output(custom_id, status: int, request_id: str | None, body) -> dict:
    error = None
    if status != 200:
        err = (body or {}).get("error") if isinstance(body, dict) else None
        err = err if isinstance(err, dict) else {}
        error = {"code": err.get("code") or err.get("type") or "error",
                 "message": err.get("message") or str(body)}
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id,
            "response": {"status_code": status, "request_id": request_id, "body": body},
            "error": error}


async def _answer(http: httpx.AsyncClient, room: asyncio.Semaphore, text: str,
                  number: int) -> dict:
    try:
        line = json.loads(text)
    except ValueError as exc:
        return _output(None, 400, None, {"error": {
            "code": "invalid_json", "message": f"line {number}: not JSON: {exc}"}})
    why = _problem(line)
    custom_id = line.get("custom_id") if isinstance(line, dict) else None
    if why is not None:
        return _output(custom_id, 400, None, {"error": {"code": "invalid_request",
                                                        "message": f"line {number}: {why}"}})
    async with room:
        r = await http.post(line["url"], json=line["body"])
        while r.status_code == 429:  # over --max-pending (n > 1 lines): when room is made
            await asyncio.sleep(float(r.headers.get("retry-after", 1)))
            r = await http.post(line["url"], json=line["body"])
    return _output(custom_id, r.status_code, r.headers.get("x-request-id"), r.json())


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
            answers = await asyncio.gather(*(_answer(http, room, text, n)
                                             for n, text in lines))
    with open(target, "w", encoding="utf-8") as f:
        for answer in answers:
            f.write(json.dumps(answer) + "\n")
    failed = sum(a["error"] is not None for a in answers)
    return {"lines": len(answers), "ok": len(answers) - failed, "failed": failed}
