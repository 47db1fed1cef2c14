"""One line of an OpenAI Batch API input file (`custom_id`, `method`, `url`, `body`) sent to
the server's own app in this process, and its answer as OpenAI's batch output writes it:
`id`, `custom_id`, `response` (`status_code`, `request_id`, `body`) and `error` (null, or
the failure's code and message)."""

from __future__ import annotations

import asyncio
import json
import logging
import uuid

import httpx

logging.getLogger("httpx").setLevel(logging.WARNING)  # not a log line per batch line

URLS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses",
        "/v1/messages", "/v1/score", "/v1/rerank")


def problem(line, urls: tuple[str, ...] = URLS) -> str | None:
    """Why a line cannot be sent (None: it can); `urls` those it may name."""
    if not isinstance(line, dict):
        return "a line must be a JSON object"
    if line.get("method", "POST") != "POST":
        return f"method must be POST, got {line.get('method')!r}"
    if line.get("url") not in urls:
        return f"url must be {'one of ' if len(urls) > 1 else ''}{', '.join(urls)}, got " \
               f"{line.get('url')!r}"
    if not isinstance(line.get("body"), dict):
        return "body must be an object"
    if line["body"].get("stream"):
        return "a batch line is answered whole: stream must be false"
    return None


def output(custom_id, status: int, request_id: str | None, body) -> dict:
    """A line's answer: the response, and its error when the status is not 200."""
    error = None
    if status != 200:
        err = (body or {}).get("error") if isinstance(body, dict) else None
        err = err if isinstance(err, dict) else {}
        error = {"code": err.get("code") or err.get("type") or "error",
                 "message": err.get("message") or str(body)}
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id,
            "response": {"status_code": status, "request_id": request_id, "body": body},
            "error": error}


def custom_id_of(text: str):
    """A line's custom_id (None for a line that is no JSON object)."""
    try:
        return json.loads(text).get("custom_id")
    except (ValueError, AttributeError):
        return None


def refused(custom_id, number: int, code: str, why: str) -> dict:
    """The answer of a line that was never sent."""
    return output(custom_id, 400, None, {"error": {"code": code,
                                                   "message": f"line {number}: {why}"}})


async def answer(http: httpx.AsyncClient, text: str, number: int,
                 urls: tuple[str, ...] = URLS) -> dict:
    """Line `number` (its `text`) sent to the app behind `http`, and its answer; a bad line
    is answered with why, naming the line."""
    try:
        line = json.loads(text)
    except ValueError as exc:
        return refused(None, number, "invalid_json", f"not JSON: {exc}")
    why = problem(line, urls)
    custom_id = line.get("custom_id") if isinstance(line, dict) else None
    if why is not None:
        return refused(custom_id, number, "invalid_request", why)
    r = await http.post(line["url"], json=line["body"])
    while r.status_code == 429:  # over --max-pending (n > 1 lines): when room is made
        await asyncio.sleep(float(r.headers.get("retry-after", 1)))
        r = await http.post(line["url"], json=line["body"])
    try:
        body = r.json()
    except ValueError:  # e.g. a 500 of plain text
        body = {"error": {"code": "error", "message": r.text or f"HTTP {r.status_code}"}}
    return output(custom_id, r.status_code, r.headers.get("x-request-id"), body)
