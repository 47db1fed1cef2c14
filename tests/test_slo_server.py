"""The `slo` policy behind the real server: latency targets as request fields, the engine's
learned step-time model, and an overloaded server's rejection as a 503 with Retry-After
(streaming too), with nothing left behind. The official `openai` client, without retries."""

from __future__ import annotations

import openai
import pytest

from server_fixtures import metric, module_server

PROMPT = "The capital of France is"


server, client = module_server("--policy", "slo", "--slo-overload", "reject",
                               "--ttft-slo-ms", "60000", "--tpot-slo-ms", "10000")


def test_requests_within_reach_of_their_targets_are_served(client):
    r = client.completions.create(model="smollm2-135m", prompt=PROMPT, max_tokens=8,
                                  temperature=0, extra_body={"ttft_slo_ms": 30000})
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 8
    chunks = list(client.chat.completions.create(
        model="smollm2-135m", messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
        stream=True, extra_body={"tpot_slo_ms": 5000}))
    assert chunks[-1].choices[0].finish_reason in ("length", "stop")


@pytest.mark.parametrize("stream", [False, True])
def test_a_request_that_cannot_make_its_ttft_is_rejected_with_a_503(server, client, stream):
    """A 1 us TTFT target has passed before the first step can run: the policy rejects the
    request before any compute, and the client sees a plain 503 saying when to retry."""
    with pytest.raises(openai.APIStatusError) as err:
        client.completions.create(model="smollm2-135m", prompt=PROMPT, max_tokens=8,
                                  stream=stream, extra_body={"ttft_slo_ms": 0.001})
    assert err.value.status_code == 503
    assert err.value.response.headers["retry-after"] == "1"
    body = err.value.body
    assert body["type"] == "service_unavailable" and "time-to-first-token" in body["message"]
    assert metric(server.url, "tidal:num_requests_running") == 0
    assert metric(server.url, "tidal:kv_cache_used_blocks") == 0
    assert metric(server.url, 'tidal:request_success_total{finished_reason="rejected"}') >= 1
