"""What SageMaker's /invocations costs over the endpoint itself, on the served path (`tidal
serve`, one model): a chat body (the first kind tried) and an embeddings body (tried after
two that refuse it), each sent alternately to its own endpoint and to /invocations; the
median latency of each and the ratio /invocations / endpoint.

Both are warmed alike first; every prompt is fresh (no prefix-cache hit).

    python benchmarks/invocations.py [--model smollm2-135m] [--requests 60]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import uuid

import httpx

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from server_fixtures import Server  # noqa: E402

ENDPOINTS = {"chat": "/v1/chat/completions", "embeddings": "/v1/embeddings"}


def body(kind: str) -> dict:
    tag = uuid.uuid4().hex[:8]
    if kind == "chat":
        return {"messages": [{"role": "user", "content": f"Say {tag}."}], "max_tokens": 1,
                "temperature": 0}
    return {"input": f"The word {tag}"}


def seconds(http: httpx.Client, url: str, kind: str) -> float:
    t = time.perf_counter()
    r = http.post(url, json=body(kind))
    elapsed = time.perf_counter() - t
    r.raise_for_status()
    return elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--requests", type=int, default=60, help="to each path, per kind")
    args = ap.parse_args()
    server = Server("--model", args.model)
    try:
        with httpx.Client(timeout=600) as http:
            for kind, path in ENDPOINTS.items():
                urls = (server.url + path, server.url + "/invocations")
                for _ in range(5):  # warm both paths alike
                    for url in urls:
                        seconds(http, url, kind)
                times: tuple[list, list] = ([], [])
                for _ in range(args.requests):  # alternating: drift hits both alike
                    for url, out in zip(urls, times):
                        out.append(seconds(http, url, kind))
                direct, invoked = (1e3 * statistics.median(t) for t in times)
                print(f"{kind}: {path} {direct:.2f} ms, /invocations {invoked:.2f} ms "
                      f"(median of {args.requests}; ratio {invoked / direct:.3f})")
    finally:
        server.stop()


if __name__ == "__main__":
    main()
