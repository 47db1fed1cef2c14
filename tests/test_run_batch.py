"""`tidal run-batch -i IN -o OUT`: an OpenAI Batch API input file answered offline through
the server's own app, line by line in the input's order, each answer as the served API gives
it (a greedy chat line's text equals the server's), bad lines answered with an error naming
the line, never a crash."""

from __future__ import annotations

import json
import subprocess
import sys

from server_fixtures import Server, openai_client

CHAT = {"model": "smollm2-135m", "max_tokens": 8, "temperature": 0,
        "messages": [{"role": "user", "content": "What is the capital of France?"}]}


def test_a_batch_file_is_answered_in_order_as_the_server_answers(tmp_path):
    lines = [
        {"custom_id": "chat", "method": "POST", "url": "/v1/chat/completions", "body": CHAT},
        {"custom_id": "text", "method": "POST", "url": "/v1/completions",
         "body": {"prompt": "Hello", "max_tokens": 3, "temperature": 0}},
        {"custom_id": "vector", "method": "POST", "url": "/v1/embeddings",
         "body": {"input": "Hello"}},
        {"custom_id": "resp", "method": "POST", "url": "/v1/responses",
         "body": {"input": "Hi", "max_output_tokens": 3}},
        {"custom_id": "bad", "method": "POST", "url": "/v1/chat/completions",
         "body": {"messages": []}},
        {"custom_id": "stream", "method": "POST", "url": "/v1/completions",
         "body": {"prompt": "x", "stream": True}},
        {"custom_id": "where", "method": "POST", "url": "/v1/files", "body": {}},
    ]
    source, target = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text("\n".join(map(json.dumps, lines)) + "\nnot json\n")
    done = subprocess.run([sys.executable, "-m", "tidal.cli", "run-batch", "-i", str(source),
                           "-o", str(target), "--num-threads", "1", "--num-kv-blocks", "256"],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "8 requests: 4 answered, 4 failed" in done.stdout
    out = [json.loads(line) for line in target.read_text().splitlines()]
    assert [o["custom_id"] for o in out] == [line["custom_id"] for line in lines] + [None]
    assert all(o["id"].startswith("batch_req_") for o in out)
    status = [o["response"]["status_code"] for o in out]
    assert status == [200, 200, 200, 200, 400, 400, 400, 400]
    assert out[2]["response"]["body"]["data"][0]["embedding"]
    assert out[3]["response"]["body"]["object"] == "response"
    assert out[4]["error"]["code"] and "messages" in out[4]["error"]["message"]
    assert "stream must be false" in out[5]["error"]["message"]
    assert "url must be one of" in out[6]["error"]["message"]
    assert out[7]["error"]["message"].startswith("line 8: not JSON")
    server = Server()
    try:
        served = openai_client(server).chat.completions.create(**CHAT)
    finally:
        server.stop()
    body = out[0]["response"]["body"]
    assert body["choices"][0]["message"]["content"] == served.choices[0].message.content
    assert body["usage"]["prompt_tokens"] == served.usage.prompt_tokens
    assert body["usage"]["completion_tokens"] == served.usage.completion_tokens
