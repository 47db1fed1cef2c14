"""The serving benchmark's client: sends a workload to any OpenAI-compatible server at its
arrival times (at most `max_concurrency` in flight), streams every response and times each
token chunk; an embeddings endpoint's whole answers are timed as they come."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

import httpx
from tqdm import tqdm

from tidal.bench.dataset import BenchRequest
from tidal.bench.metrics import RequestResult


@dataclass
class Target:
    """Where and how to send: the server, endpoint and the request's fixed fields."""

    base_url: str = "http://127.0.0.1:8000"
    endpoint: str = "/v1/completions"  # or /v1/chat/completions, /v1/embeddings
    model: str | None = None  # None: the first model /v1/models lists
    api_key: str | None = None
    ignore_eos: bool = False
    temperature: float = 0.0
    sampling: dict = field(default_factory=dict)  # top_p, top_k, min_p, use_beam_search
    logprobs: int | None = None  # each token's top logprobs, asked as the endpoint asks
    extra_body: dict = field(default_factory=dict)  # merged into every body, last
    extra_headers: dict = field(default_factory=dict)
    request_id_prefix: str | None = None  # each request's x-request-id: prefix + its index
    timeout: float = 6 * 3600

    @property
    def chat(self) -> bool:
        return self.endpoint.rstrip("/").endswith("chat/completions")

    @property
    def embeddings(self) -> bool:
        return self.endpoint.rstrip("/").endswith("embeddings")

    def headers(self, index: int | None = None) -> dict[str, str]:
        """The key's, --header's and, for request `index`, its x-request-id."""
        headers = dict(self.extra_headers)
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        if index is not None and self.request_id_prefix is not None:
            headers["x-request-id"] = f"{self.request_id_prefix}{index}"
        return headers


def payload(target: Target, prompt: str, output_len: int, model: str | None = None) -> dict:
    if target.embeddings:
        return {"model": model or target.model, "input": prompt, **target.extra_body}
    body = {"model": model or target.model, "max_tokens": output_len,
            "temperature": target.temperature, **target.sampling,
            "stream": True, "stream_options": {"include_usage": True}}
    if target.chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    if target.logprobs is not None:
        body.update({"logprobs": True, "top_logprobs": target.logprobs} if target.chat
                    else {"logprobs": target.logprobs})
    if target.ignore_eos:
        body["ignore_eos"] = True  # vLLM, SGLang, llama-server and tidal all read it
    return {**body, **target.extra_body}


def _chunk_text(chunk: dict, chat: bool) -> str:
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    if chat:
        return (choices[0].get("delta") or {}).get("content") or ""
    return choices[0].get("text") or ""


async def embed_one(http: httpx.AsyncClient, target: Target, prompt: str,
                    req: BenchRequest, result: RequestResult, t_start: float,
                    index: int) -> None:
    """Send embeddings request `index`: its whole answer is its first and last (TTFT is
    its latency), its prompt's tokens as the server counted them."""
    sent = time.perf_counter()
    result.start = sent - t_start
    try:
        resp = await http.post(target.base_url + target.endpoint,
                               json=payload(target, prompt, 0, req.model),
                               headers=target.headers(index))
        result.latency = result.ttft = time.perf_counter() - sent
        if resp.status_code != 200:
            result.error = f"HTTP {resp.status_code}: {resp.text[:500]}"
            return
        body = resp.json()
        result.prompt_len = (body.get("usage") or {}).get("prompt_tokens") or result.prompt_len
        result.success = bool(body.get("data"))
        if not result.success:
            result.error = "the answer holds no embedding"
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"


async def send_one(http: httpx.AsyncClient, target: Target, prompt: str, req: BenchRequest,
                   result: RequestResult, t_start: float, index: int) -> None:
    """Stream request `index`, filling `result` (timings relative to `t_start`)."""
    if target.embeddings:
        return await embed_one(http, target, prompt, req, result, t_start, index)
    sent = time.perf_counter()
    result.start = sent - t_start
    last, chunks, text = sent, 0, []
    try:
        async with http.stream("POST", target.base_url + target.endpoint,
                               json=payload(target, prompt, req.output_len, req.model),
                               headers=target.headers(index)) as resp:
            if resp.status_code != 200:
                result.error = f"HTTP {resp.status_code}: {(await resp.aread()).decode()[:500]}"
                return
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = json.dumps(chunk["error"])[:500]
                    return
                if chunk.get("usage"):
                    result.output_len = chunk["usage"].get("completion_tokens") or 0
                    result.prompt_len = chunk["usage"].get("prompt_tokens") or result.prompt_len
                piece = _chunk_text(chunk, target.chat)
                if piece:
                    now = time.perf_counter()
                    if chunks == 0:
                        result.ttft = now - sent
                    else:
                        result.itl.append(now - last)
                    last, chunks = now, chunks + 1
                    text.append(piece)
        result.latency = last - sent
        result.output_len = result.output_len or chunks
        result.text = "".join(text)
        result.success = chunks > 0
        if not result.success:
            result.error = "the stream ended without any token"
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"


def wait_ready(target: Target, timeout: float) -> str:
    """Wait up to `timeout` s for the server to list its models (it may still be
    starting); the first one's name. SystemExit saying why when it does not."""
    deadline, told, why = time.monotonic() + timeout, False, ""
    url = target.base_url.rstrip("/") + "/v1/models"
    while True:
        try:
            resp = httpx.get(url, headers=target.headers(), timeout=30)
            if resp.status_code in (401, 403):
                raise SystemExit(f"bench serve: {url} refused the key ({resp.status_code}): "
                                 f"pass --api-key")
            if resp.status_code == 200:
                return resp.json()["data"][0]["id"]
            why = f"HTTP {resp.status_code}"
        except (httpx.HTTPError, ValueError, KeyError, IndexError) as exc:
            why = f"{type(exc).__name__}: {exc}"
        if time.monotonic() >= deadline:
            raise SystemExit(f"bench serve: {url} did not answer within {timeout:g} s "
                             f"(--ready-check-timeout-sec); last: {why}")
        if not told:
            print(f"waiting for {target.base_url} (up to {timeout:g} s): {why}")
            told = True
        time.sleep(1.0)


async def run_workload(target: Target, requests: list[BenchRequest], prompts: list[str],
                       send_times: list[float], max_concurrency: int | None = None,
                       progress: bool = True) -> tuple[list[RequestResult], float]:
    """Send every request at its time; returns the results and the wall duration."""
    if target.model is None:
        target.model = await asyncio.to_thread(wait_ready, target, 30.0)
    results = [RequestResult(prompt_len=r.prompt_len) for r in requests]
    gate = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    bar = tqdm(total=len(requests), disable=not progress, unit="req")
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=target.timeout, limits=limits) as http:
        t_start = time.perf_counter()

        async def one(i: int) -> None:
            await asyncio.sleep(max(0.0, t_start + send_times[i] - time.perf_counter()))
            if gate is None:
                await send_one(http, target, prompts[i], requests[i], results[i], t_start, i)
            else:
                async with gate:
                    await send_one(http, target, prompts[i], requests[i], results[i], t_start,
                                   i)
            bar.update(1)

        await asyncio.gather(*(one(i) for i in range(len(requests))))
        duration = time.perf_counter() - t_start
    bar.close()
    return results, duration
