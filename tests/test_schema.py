"""The OpenAPI schema tells the truth: schemathesis runs every one of its checks (bar one)
over every operation of a real keyed `tidal serve` from the server's own /openapi.json, and
none may fail. Left out: positive_data_acceptance, as a schema-valid body may still be a
400 naming its field for what JSON Schema cannot state (the vocabulary's size, a prompt's
length in tokens, n x max_tokens, which role a message needs, 4.0 for an integer); and the
routes that pause the server or put it to sleep (test_pause.py and test_weight_updates.py
run them).

TIDAL_SCHEMA_EXAMPLES sets the examples per operation (default 8)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from server_fixtures import Server

KEY = "schema-key"
EXAMPLES = int(os.environ.get("TIDAL_SCHEMA_EXAMPLES", "8"))
AUTH = {"authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def server():
    s = Server("--api-key", KEY, "--max-model-len", "512", "--max-total-tokens", "4",
               "--max-pending", "16")
    yield s
    s.stop()


def test_the_schema_documents_the_answers_the_server_gives(server):
    schema = httpx.get(server.url + "/openapi.json", headers=AUTH).json()
    assert "HTTPValidationError" not in schema["components"]["schemas"]
    for path, operations in schema["paths"].items():
        for op in operations.values():
            assert "422" not in op["responses"], path  # invalid bodies are 400s
    completions = schema["paths"]["/v1/completions"]["post"]["responses"]
    assert {"400", "401", "413", "429", "503"} <= set(completions)
    assert set(completions["200"]["content"]) == {"application/json", "text/event-stream"}
    assert set(schema["paths"]["/metrics"]["get"]["responses"]["200"]["content"]) == \
        {"text/plain"}
    r = httpx.post(server.url + "/v1/completions", headers=AUTH,
                   json={"prompt": "Hi", "max_tokens": 1})
    assert r.status_code == 200 and r.headers["content-type"] == "application/json"
    r = httpx.request("TRACE", server.url + "/version")
    assert r.status_code == 405 and r.headers["allow"] == "GET", r.headers


@pytest.mark.parametrize("path,body,param", [
    ("/detokenize", {"tokens": [True]}, "tokens.0"),
    ("/detokenize", {"tokens": ["0"]}, "tokens.0"),
    ("/v1/completions", {"prompt": "Hi", "max_tokens": "1"}, "max_tokens"),
    ("/v1/completions", {"prompt": ""}, "prompt"),
    ("/v1/completions", {"prompt": "Hi", "model": ""}, "model"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
])
def test_what_the_schema_refuses_the_server_refuses(server, path, body, param):
    r = httpx.post(server.url + path, headers=AUTH, json=body)
    status = 404 if param == "model" else 400  # a model not served: OpenAI's 404
    assert r.status_code == status and r.json()["error"]["param"] == param, r.text


def test_schemathesis_finds_no_failure_with_every_check(server, tmp_path):
    cli = shutil.which("schemathesis", path=str(Path(sys.executable).parent))
    run = subprocess.run(
        [cli, "run", server.url + "/openapi.json", "-H", f"Authorization: Bearer {KEY}",
         "--checks", "all", "--exclude-checks", "positive_data_acceptance",
         # a pause or a sleep holds every later request until a resume the run need not send
         *[arg for path in ("/pause", "/pause_generation", "/sleep",
                            "/release_memory_occupation") for arg in ("--exclude-path", path)],
         "--max-examples", str(EXAMPLES), "--seed", "1", "--request-timeout", "60",
         "--max-failures", "50", "--no-color", "--report-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=600, cwd=tmp_path)  # its cache goes there
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
    assert " passed" in run.stdout
