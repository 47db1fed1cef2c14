"""Custom logits processors (`logits_processors`, `--logits-processors`) and a request's
`extra_args` (`vllm_xargs`): offline on a tiny random model and end to end on a real
`tidal serve` with the official `openai` client."""

from __future__ import annotations

import openai
import pytest

from model_fixtures import tiny_folder
from server_fixtures import module_server
from tidal import LLM, SamplingParams
from tidal.model.logits_processors import check_extra_args, load_processors

PROCESSOR = "tests.processor_fixtures:OnlyToken"  # importable from the repository's root
server, client = module_server("--logits-processors", PROCESSOR)


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    folder = tiny_folder(tmp_path_factory.mktemp("tiny"), "llama")
    return LLM(str(folder), dtype="float32", num_kv_blocks=128, block_size=4,
               logits_processors=[PROCESSOR])


def test_a_processor_changes_the_rows_that_ask_for_it_alone(llm):
    """In one batch: the row with target_token gets it alone (its logprobs the processed
    distribution's), from `after` tokens on; the others are what they are without it."""
    prompt = {"prompt_token_ids": [5, 9, 13, 2, 7]}
    plain = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=2)
    alone = llm.generate([prompt], plain, use_tqdm=False)[0].outputs[0]
    target = (alone.token_ids[0] + 1) % 50
    asked = SamplingParams(max_tokens=6, temperature=0.8, seed=1, ignore_eos=True, logprobs=2,
                           extra_args={"target_token": target, "after": 2})
    both = llm.generate([prompt, prompt], [plain, asked], use_tqdm=False)
    assert both[0].outputs[0].token_ids == alone.token_ids
    got = both[1].outputs[0]
    assert got.token_ids[2:] == [target] * 4 and got.token_ids[:2] != [target] * 2
    assert all(e.logprob == 0.0 for e in got.logprobs[2:])  # the only token left


def test_extra_args_are_checked_by_the_processors(llm, tmp_path):
    bad = SamplingParams(max_tokens=2, extra_args={"target_token": "x"})
    with pytest.raises(ValueError, match="target_token"):
        llm.generate([{"prompt_token_ids": [5, 9]}], bad, use_tqdm=False)
    with pytest.raises(ValueError, match="none is loaded"):
        check_extra_args([], {"target_token": 3})
    with pytest.raises(ValueError, match="string keys"):
        SamplingParams(extra_args={1: 2})
    for name in ("tests.processor_fixtures:Missing", "no.such.module:X", "tidal.core:Scheduler"):
        with pytest.raises(ValueError, match="logits processor"):
            load_processors([name])


def test_vllm_xargs_reach_the_servers_processor(server, client):
    tok = httpx_tokens(server, " yes")
    out = client.completions.create(model="smollm2-135m", prompt="Is the sky blue?",
                                    max_tokens=5, temperature=0,
                                    extra_body={"vllm_xargs": {"target_token": tok},
                                                "ignore_eos": True})
    assert out.choices[0].text == " yes" * 5
    plain = client.completions.create(model="smollm2-135m", prompt="Is the sky blue?",
                                      max_tokens=5, temperature=0)
    assert plain.choices[0].text != " yes" * 5
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="smollm2-135m", prompt="Hi", max_tokens=2,
                                  extra_body={"vllm_xargs": {"target_token": -1}})
    assert err.value.body["param"] == "vllm_xargs" and "target_token" in err.value.body["message"]


def httpx_tokens(server, text: str) -> int:
    import httpx

    ids = httpx.post(server.url + "/tokenize", json={"prompt": text}).json()["tokens"]
    assert len(ids) == 1
    return ids[0]
