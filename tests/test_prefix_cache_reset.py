"""vLLM's prefix cache reset (SGLang's /flush_cache): after it a prompt seen before finds no
cached block, offline (`LLM.reset_prefix_cache`) and served (`POST /reset_prefix_cache`,
behind the key, on every data-parallel core), and its answer is unchanged. The pool and
scheduler invariants under resets at any moment: the state machines of test_kv_cache.py
and test_scheduler_stateful.py."""

from __future__ import annotations

import httpx

from model_fixtures import tiny_folder
from server_fixtures import Server, openai_client
from tidal import LLM, SamplingParams

PROMPT = "A long list of fruits: apple, banana, cherry, date, elderberry, fig, grape, kiwi, "
KEY = "reset-key"


def test_offline_reset_makes_a_seen_prompt_cold_and_changes_no_token(tmp_path):
    llm = LLM(str(tiny_folder(tmp_path, "llama")), dtype="float32", num_kv_blocks=64)
    params = SamplingParams(max_tokens=6, temperature=0.0)
    first, again = (llm.generate(PROMPT, params, use_tqdm=False)[0] for _ in range(2))
    assert first.num_cached_tokens == 0 and again.num_cached_tokens >= 16
    assert llm.reset_prefix_cache() is True
    cold = llm.generate(PROMPT, params, use_tqdm=False)[0]
    assert cold.num_cached_tokens == 0
    assert cold.outputs[0].token_ids == again.outputs[0].token_ids == first.outputs[0].token_ids


def test_served_reset_reaches_every_core_behind_the_key():
    server = Server("--api-key", KEY, "--data-parallel-size", "2")
    try:
        client = openai_client(server, KEY)
        messages = [{"role": "user", "content": PROMPT}]

        def cached() -> int:
            usage = client.chat.completions.create(model="smollm2-135m", messages=messages,
                                                   max_tokens=2, temperature=0).usage
            return usage.prompt_tokens_details.cached_tokens

        assert max(cached() for _ in range(4)) > 0  # a core has it, whichever was picked
        assert httpx.post(server.url + "/reset_prefix_cache").status_code == 401
        auth = {"authorization": f"Bearer {KEY}"}
        for path in ("/reset_prefix_cache", "/flush_cache"):
            assert httpx.post(server.url + path, headers=auth).status_code == 200
            for _ in range(2):  # whichever core the dispatcher picks, cold
                assert cached() == 0
                httpx.post(server.url + path, headers=auth)
    finally:
        log = server.stop()
    assert log.count("prefix cache reset") == 12  # 6 resets, each heard by both cores
