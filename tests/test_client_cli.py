"""`tidal chat` and `tidal complete` against a real server (greedy by the server's
`--override-generation-config`): a one-shot answer equals the API's for the same request, a
piped conversation carries its history, and a refusal or a missing server ends the command
with the reason and exit status 1."""

from __future__ import annotations

import subprocess
import sys

import pytest

from server_fixtures import Server, free_port, openai_client

MODEL = "smollm2-135m"


@pytest.fixture(scope="module")
def server():
    s = Server("--override-generation-config", '{"temperature": 0}')
    yield s
    s.stop()


def tidal(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tidal.cli", *args], input=stdin,
                          capture_output=True, text=True, timeout=120)


def test_chat_answers_as_the_api_and_keeps_the_conversation(server):
    url, client = server.url + "/v1", openai_client(server)

    def answer(messages):
        return client.chat.completions.create(model=MODEL, messages=messages,
                                              max_tokens=12).choices[0].message.content

    first = [{"role": "system", "content": "Be brief."},
             {"role": "user", "content": "Name a colour."}]
    one = tidal("chat", "--url", url, "--max-tokens", "12", "--system-prompt", "Be brief.",
                "-q", "Name a colour.")
    assert one.returncode == 0 and one.stdout == answer(first) + "\n"
    assert "HTTP Request" not in one.stderr  # no log line per request
    second = [*first, {"role": "assistant", "content": answer(first)},
              {"role": "user", "content": "And another?"}]
    piped = tidal("chat", "--url", url, "--max-tokens", "12", "--system-prompt", "Be brief.",
                  stdin="Name a colour.\n\nAnd another?\n")
    assert piped.returncode == 0
    assert piped.stdout == f"{answer(first)}\n{answer(second)}\n"


def test_complete_continues_each_line(server):
    url, client = server.url + "/v1", openai_client(server)
    want = [client.completions.create(model=MODEL, prompt=p, max_tokens=6).choices[0].text
            for p in ("1, 2, 3,", "The sky is")]
    out = tidal("complete", "--url", url, "--max-tokens", "6", stdin="1, 2, 3,\nThe sky is\n")
    assert out.returncode == 0 and out.stdout == "".join(w + "\n" for w in want)


def test_refusals_and_a_missing_server_end_with_the_reason(server):
    refused = tidal("chat", "--url", server.url + "/v1", "--max-tokens", "0", "-q", "hi")
    assert refused.returncode == 1 and "max_tokens must be at least 1" in refused.stderr
    unknown = tidal("complete", "--url", server.url + "/v1", "--model-name", "nope", "-q", "x")
    assert unknown.returncode == 1 and "'nope' does not exist" in unknown.stderr
    nobody = tidal("chat", "--url", f"http://127.0.0.1:{free_port()}/v1", "-q", "hi")
    assert nobody.returncode == 1 and "no server answers at" in nobody.stderr
