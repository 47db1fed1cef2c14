"""Start a real `tidal serve` on a free loopback port, wait until it is healthy, stop it;
and the bad requests every tidal HTTP front must refuse with a 400."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import tempfile
import time

import httpx

from tidal.model.hosts import free_port


class Server:
    def __init__(self, *flags: str, ready_s: float = 180, scheme: str = "http",
                 **client: object) -> None:
        """`scheme` and `client` (httpx.Client's arguments: TLS `verify`, a Unix socket's
        `transport`): how to reach it."""
        self.flags = flags
        self.port = free_port()
        self.url = f"{scheme}://127.0.0.1:{self.port}"
        self.log = tempfile.TemporaryFile("w+")  # a pipe could fill up and stall the server
        self.files = tempfile.TemporaryDirectory()  # its Batch API store, unless flags name one
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tidal.cli", "serve", "--port", str(self.port),
             "--num-kv-blocks", "256", "--num-threads", "1",
             "--batch-store", f"{self.files.name}/batches.sqlite", *flags],
            stdout=self.log, stderr=subprocess.STDOUT, text=True, start_new_session=True)
        with httpx.Client(**client) as http:
            self._wait_healthy(http, ready_s)

    def _wait_healthy(self, http: httpx.Client, ready_s: float) -> None:
        deadline = time.monotonic() + ready_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited: {self.output()}")
            with contextlib.suppress(httpx.HTTPError):
                if http.get(self.url + "/health", timeout=2).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise TimeoutError(f"server did not become healthy in {ready_s:.0f} s: "
                                   f"{self.stop()[-3000:]}")
            time.sleep(0.3)

    def core_pid(self) -> int:
        """The engine core's process id (/health tells it to a caller with the key)."""
        key = self.flags[self.flags.index("--api-key") + 1] if "--api-key" in self.flags else None
        headers = {"authorization": f"Bearer {key}"} if key else {}
        return httpx.get(self.url + "/health", headers=headers).json()["engine_core_pid"]

    def stop(self, timeout: float = 30) -> str:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        return self.output()

    def output(self) -> str:
        """The server's log so far (read without moving the offset the server writes at)."""
        fd, chunks, at = self.log.fileno(), [], 0
        while chunk := os.pread(fd, 1 << 20, at):
            chunks.append(chunk)
            at += len(chunk)
        return b"".join(chunks).decode(errors="replace")


def openai_client(server: "Server", key: str = "none"):
    """The official client on a server's /v1, without retries (a test sees each answer)."""
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0)


def module_server(*flags: str):
    """A test module's `server` (one `Server(*flags)` for the module) and `client` (the
    official client on it) fixtures: `server, client = module_server(...)`."""
    import pytest

    @pytest.fixture(scope="module")
    def server():
        s = Server(*flags)
        yield s
        s.stop()

    @pytest.fixture(scope="module")
    def client(server):
        return openai_client(server)

    return server, client


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with contextlib.suppress(OSError):  # a zombie is dead too
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    return True


def wait_for_new_core(server: "Server", core: int, timeout: float = 120) -> None:
    """Until the server is healthy again with an engine core other than `core` (restarted
    after it died), within `timeout` seconds; then that the old one is gone."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if httpx.get(server.url + "/health", timeout=10).status_code == 200 \
                and server.core_pid() != core:
            break
        time.sleep(0.5)
    assert server.core_pid() != core and not pid_alive(core)


def _labels(text: str) -> dict[str, str]:
    return dict(re.findall(r'(\w+)="([^"]*)"', text))


def metric(url: str, name: str) -> float:
    """A sample of /metrics: `name`, or `name{label="value",...}` matching those labels
    (others, such as model_name, may be there too)."""
    base, _, wanted = name.partition("{")
    for line in httpx.get(url + "/metrics").text.splitlines():
        sample, _, value = line.rpartition(" ")
        line_base, _, labels = sample.partition("{")
        if line_base == base and _labels(wanted).items() <= _labels(labels).items():
            return float(value)
    raise KeyError(name)


def finished(server: Server, reason: str = "length") -> float:
    """Requests the server counts as ended so (0 before the first)."""
    try:
        return metric(server.url, f'tidal:request_success_total{{finished_reason="{reason}"}}')
    except KeyError:
        return 0


BAD = [  # (path, body) pairs the server refuses with 400 and an OpenAI error body
    ("/v1/completions", {"prompt": "", "max_tokens": 4}),
    ("/v1/completions", {"prompt": [], "max_tokens": 4}),
    ("/v1/chat/completions", {"messages": []}),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "hi"}]}),
    ("/v1/completions", {"prompt": "hi " * 9000}),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 9000}),
    ("/v1/completions", {"prompt": "hi", "max_tokens": -1}),
    ("/v1/completions", {"prompt": "hi", "temperature": -1}),
    ("/v1/completions", {"prompt": "hi", "top_p": 7}),
    ("/v1/completions", {"prompt": "hi", "presence_penalty": 1e9}),
    ("/v1/completions", {"prompt": "hi", "n": 10000}),
    ("/v1/completions", {"prompt": "hi", "logprobs": 1000}),
    ("/v1/completions", {"prompt": [10 ** 9], "max_tokens": 2}),
    ("/v1/completions", {"prompt": "hi", "stop": [""]}),
    ("/v1/completions", {"max_tokens": 2}),
]
