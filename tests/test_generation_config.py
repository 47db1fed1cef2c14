"""The model's generation config (tidal/model/generation_config.py): every end-of-turn token it
lists ends a generation (config.json, generation_config.json, a GGUF's EOS/EOT/EOM and the
tokens llama.cpp ends at), and its sampling defaults fill what a request leaves unset, as
vLLM's `--generation-config auto` (or none: 'vllm'; `--override-generation-config` over
them), offline and served through the official client."""

from __future__ import annotations

import json
import logging

import gguf
import httpx
import pytest

from model_fixtures import embedded_folder, tiny_folder
from server_fixtures import Server, openai_client
from tidal import LLM, SamplingParams
from tidal.engine.config import EngineConfig
from tidal.model.generation_config import end_token_ids, sampling_defaults
from tidal.model.gguf_convert import generation_config
from tidal.model.gguf_file import open_gguf

TURN_END = 7  # the tiny model's end-of-turn token (generation_config.json lists it)
DEFAULTS = {"temperature": 0.0, "top_k": 20, "max_new_tokens": 5}
MESSAGES = [{"role": "user", "content": "Name a colour."}]


def with_generation_config(folder, **fields):
    (folder / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": 1, "eos_token_id": [2, TURN_END], **fields}))
    return folder


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return with_generation_config(tiny_folder(tmp_path_factory.mktemp("gen"), "llama"),
                                  do_sample=True, max_length=99, **DEFAULTS)


def test_end_tokens_come_from_the_tokenizer_config_and_generation_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": [5, 6]}))
    assert end_token_ids(tmp_path, 2) == (2, 5, 6)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [6, 9, 2]}))
    assert end_token_ids(tmp_path, 2) == (2, 5, 6, 9)
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": None}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 4}))
    assert end_token_ids(tmp_path, None) == (4,)
    (tmp_path / "generation_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="generation_config.json does not read as JSON"):
        end_token_ids(tmp_path, 2)


def test_sampling_defaults_read_the_file_then_the_overrides_each_checked(folder, tmp_path,
                                                                          caplog):
    want = {"temperature": 0.0, "top_k": 20, "max_tokens": 5}  # do_sample, max_length: not
    assert sampling_defaults(folder) == want
    assert sampling_defaults(tmp_path, str(folder)) == want  # another folder's file
    assert sampling_defaults(folder, "vllm") == sampling_defaults(folder, "tidal") == {}
    assert sampling_defaults(folder, "auto", '{"temperature": 0.5, "min_p": 0.1}') == {
        **want, "temperature": 0.5, "min_p": 0.1}
    assert sampling_defaults(tmp_path) == {}  # no file: none
    with pytest.raises(ValueError, match="no generation_config.json there"):
        sampling_defaults(folder, str(tmp_path))
    # A model's value out of a request's range is left out (with a warning naming it); the
    # others stay. The same value as an override is refused, naming it.
    for bad in ({"temperature": 3}, {"top_k": 1.5}, {"top_p": "0.9"}, {"top_p": 0},
                {"max_new_tokens": 0}, {"repetition_penalty": 0}):
        (tmp_path / "generation_config.json").write_text(json.dumps({**bad, "min_p": 0.2}))
        with caplog.at_level(logging.WARNING, logger="tidal.model"):
            assert sampling_defaults(tmp_path) == {"min_p": 0.2}
        key = next(iter(bad))
        assert f"{key} must be" in caplog.text and "left out" in caplog.text
        caplog.clear()
        with pytest.raises(ValueError, match=f"override_generation_config: {key} must be"):
            EngineConfig.from_kwargs(override_generation_config=json.dumps(bad))
    for bad, why in (("{", "not JSON"), ("[1]", "a JSON object"), ('{"temp": 1}', "'temp'")):
        with pytest.raises(ValueError, match=why):
            EngineConfig.from_kwargs(override_generation_config=bad)


def test_a_ggufs_end_tokens_and_sampling_fields_become_its_generation_config(tmp_path):
    path = tmp_path / "m.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    tokens = ["a", "<|im_end|>", "<end_of_turn>", "b", "<|eom_id|>", "c", "end"]
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.NORMAL] * len(tokens))
    w.add_eos_token_id(0)
    w.add_eot_token_id(6)
    w.add_float32("general.sampling.temp", 0.6)
    w.add_int32("general.sampling.top_k", 40)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    cfg = generation_config(open_gguf(path))
    assert cfg == {"eos_token_id": [0, 6, 1, 2, 4], "temperature": 0.6, "top_k": 40}
    # The embedded model ends at <|im_end|> and, as llama.cpp does, at <|endoftext|>.
    saved = json.loads((embedded_folder() / "generation_config.json").read_text())
    assert saved["eos_token_id"] == [2, 0]


def test_every_end_token_ends_a_generation_and_the_defaults_fill_in(folder):
    llm = LLM(str(folder), dtype="float32", num_kv_blocks=64, max_num_seqs=4)
    assert llm.engine.core.eos_token_ids == (2, TURN_END)
    forced = SamplingParams(max_tokens=6, logit_bias={TURN_END: 100.0}, temperature=0.0)
    out = llm.generate("hello", forced, use_tqdm=False)[0].outputs[0]
    assert (out.token_ids, out.finish_reason) == ([TURN_END], "stop")
    out = llm.generate("hello", SamplingParams(max_tokens=6, logit_bias={TURN_END: 100.0},
                                               ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert (out.token_ids, out.finish_reason) == ([TURN_END] * 6, "length")
    out = llm.generate("hello", SamplingParams(max_tokens=6, logit_bias={TURN_END: 100.0},
                                               min_tokens=2), use_tqdm=False)[0].outputs[0]
    assert TURN_END not in out.token_ids[:2] and out.token_ids[2:] == [TURN_END]
    # Given no parameters: the model's (greedy, top_k 20, 5 tokens), not SamplingParams'.
    params = llm.get_default_sampling_params()
    assert (params.temperature, params.top_k, params.max_tokens) == (0.0, 20, 5)
    greedy = llm.generate("hello", SamplingParams(max_tokens=5, temperature=0.0),
                          use_tqdm=False)[0].outputs[0].token_ids
    assert TURN_END not in greedy and len(greedy) == 5
    assert llm.generate("hello", use_tqdm=False)[0].outputs[0].token_ids == greedy
    # The beam search ends a beam at the turn's end too.
    from tidal.engine.beam_search import BeamSearchParams
    beams = llm.beam_search("hello", BeamSearchParams(beam_width=2, max_tokens=4))
    assert all(TURN_END not in b.token_ids[:-1] for b in beams[0].sequences)


@pytest.fixture(scope="module")
def server(folder):
    s = Server("--model", str(folder), "--dtype", "float32",
               "--override-generation-config", '{"max_new_tokens": 4}')
    yield s
    s.stop()


def test_served_requests_take_the_models_defaults_and_stop_at_its_turn_end(server):
    client = openai_client(server)
    model = client.models.list().data[0].id
    greedy = client.chat.completions.create(model=model, messages=MESSAGES, temperature=0,
                                            max_tokens=4)
    assert greedy.usage.completion_tokens == 4
    for seed in (1, 2):  # no temperature given: the model's 0, whatever the seed
        out = client.chat.completions.create(model=model, messages=MESSAGES, seed=seed)
        assert out.choices[0].message.content == greedy.choices[0].message.content
        assert out.usage.completion_tokens == 4  # the override's max_new_tokens
    sampled = {client.chat.completions.create(
        model=model, messages=MESSAGES, temperature=1.0, max_tokens=4,
        seed=seed).choices[0].message.content for seed in range(4)}
    assert len(sampled) > 1  # a request's own temperature wins
    answer = client.responses.create(model=model, input=MESSAGES[0]["content"])
    assert answer.output_text == greedy.choices[0].message.content
    assert answer.usage.output_tokens == 4
    assert answer.temperature == 0.0  # the object echoes what it ran with
    reply = httpx.post(server.url + "/v1/messages", json={
        "model": model, "messages": MESSAGES, "max_tokens": 4}).json()
    assert reply["content"][0]["text"] == greedy.choices[0].message.content
    out = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=8,
                                         logit_bias={str(TURN_END): 100})
    assert (out.usage.completion_tokens, out.choices[0].finish_reason) == (1, "stop")
    out = client.completions.create(model=model, prompt="hi", max_tokens=8,
                                    logit_bias={str(TURN_END): 100},
                                    extra_body={"ignore_eos": True})
    assert (out.usage.completion_tokens, out.choices[0].finish_reason) == (8, "length")
    assert "sampling defaults from the model's generation config" in server.output()


def test_a_models_value_out_of_range_is_left_out_and_vllm_takes_none(tmp_path):
    folder = with_generation_config(tiny_folder(tmp_path, "llama"), temperature=7, top_k=3)
    llm = LLM(str(folder), dtype="float32", num_kv_blocks=16)
    params = llm.get_default_sampling_params()
    assert (params.temperature, params.top_k) == (SamplingParams().temperature, 3)
    llm = LLM(str(folder), dtype="float32", num_kv_blocks=16, generation_config="vllm")
    assert llm.get_default_sampling_params() == SamplingParams()
