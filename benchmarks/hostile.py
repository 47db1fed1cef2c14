"""Hostile clients for the soak (`benchmarks/soak.py --hostile`): what a careful attacker
sends a public endpoint. Slowloris connections trickle a request a byte at a time and are
reopened as soon as the server closes them; flood clients send, back to back, requests that
amplify (512 prompts x n=16), carry a megabyte of choices, or a constraint the grammar
engine cannot build. The server must refuse each with an OpenAI error body (or, for a
constraint that fails only while decoding, end it with one), close each trickle by its
read timeout, and keep serving the normal clients."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx

LOOP = {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}}
REFUSED = [  # (name, endpoint, body)
    ("amplification", "/v1/completions", {"prompt": ["x"] * 512, "n": 16, "max_tokens": 1}),
    ("megabyte of choices", "/v1/completions",
     {"prompt": "Hi", "max_tokens": 4, "guided_choice": [f"c{i}" for i in range(100_000)]}),
    ("3,000 choices", "/v1/completions",
     {"prompt": "Hi", "max_tokens": 4, "guided_choice": [f"c{i}" for i in range(3_000)]}),
    ("regex bomb", "/v1/completions",
     {"prompt": "Hi", "max_tokens": 4, "guided_regex": "a{1000000}"}),
    ("nested regex", "/v1/completions",
     {"prompt": "Hi", "max_tokens": 4, "guided_regex": "((a{100}){100}){100}"}),
    ("self-referential schema", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "guided_json": LOOP}),
]
# A constraint may pass its first mask and fail at a later token: then the request ends
# with an error (a 500 naming the constraint), never as a success.
DECODE_FAILURE = "the output constraint failed while decoding"


@dataclass
class Hostility:
    """How many hostile clients run, and what they saw (`outcomes`, `problems`)."""

    slowloris: int = 16  # connections trickling a request, each reopened when closed
    trickle_every: float = 1.0  # seconds between a trickle's bytes
    read_timeout: float = 30.0  # the server's --request-read-timeout
    floods: int = 2  # clients sending refused requests back to back
    outcomes: Counter = field(default_factory=Counter)
    problems: list[str] = field(default_factory=list)
    stop: asyncio.Event = field(default_factory=asyncio.Event)

    def problem(self, what: str) -> None:
        self.outcomes["problem"] += 1
        if len(self.problems) < 20:
            self.problems.append(what)


async def hostile_clients(url: str, h: Hostility) -> None:
    """Run the hostile clients until `h.stop` is set."""
    host, port = url.removeprefix("http://").split(":")
    async with httpx.AsyncClient(timeout=120) as http:
        await asyncio.gather(*(trickle(host, int(port), h) for _ in range(h.slowloris)),
                             *(flood(http, url, h, i) for i in range(h.floods)))


async def trickle(host: str, port: int, h: Hostility) -> None:
    """Headers that never end, a byte every `trickle_every` seconds; once the server closes
    the connection, a new one."""
    while not h.stop.is_set():
        reader, writer = await asyncio.open_connection(host, port)
        t0 = time.monotonic()
        writer.write(b"GET /version HTTP/1.1\r\nHost: x\r\nX-Slow: ")
        try:
            while not h.stop.is_set() and not reader.at_eof():
                await writer.drain()
                try:
                    await asyncio.wait_for(reader.read(1024), h.trickle_every)
                except asyncio.TimeoutError:
                    writer.write(b"a")
                    continue
        except ConnectionError:
            pass
        held = time.monotonic() - t0
        writer.close()
        if h.stop.is_set():
            return
        h.outcomes["slowloris closed"] += 1
        if held > h.read_timeout + 2 * h.trickle_every + 5:
            h.problem(f"a trickling connection held {held:.0f} s")


async def flood(http: httpx.AsyncClient, url: str, h: Hostility, start: int) -> None:
    """The refused requests, one after another, round robin."""
    i = start
    while not h.stop.is_set():
        name, path, body = REFUSED[i % len(REFUSED)]
        i += 1
        r = await http.post(url + path, json=body)
        try:
            message = r.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            h.problem(f"{name}: HTTP {r.status_code} without an error body: {r.text[:200]}")
            continue
        if 400 <= r.status_code < 500 or (r.status_code == 500
                                          and message.startswith(DECODE_FAILURE)):
            h.outcomes[f"{name}: {r.status_code}"] += 1
        else:
            h.problem(f"{name}: HTTP {r.status_code}: {message[:200]}")
