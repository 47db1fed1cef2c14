"""Multi-LoRA against PEFT: greedy tokens equal each adapter's merged model
(`merge_and_unload`), with three adapters of different ranks and targets mixed in one batch
with base-model requests, chunked prefill and prefix hits, on the C++ decoder and on the
PyTorch path; loading refuses what tidal cannot serve, by name. Across processes and
restarts: test_lora_parallel.py."""

from __future__ import annotations

import json

import pytest
import torch

from tidal import LLM, SamplingParams
from tidal.model.lora import LoRAError
from tidal.spec import GuessTree

from lora_fixtures import (MAX_TOKENS, PROMPTS, lora_setup, make_adapter, merged_model, run,
                           token_logprobs)
from model_fixtures import hf_greedy, small_folder


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    return lora_setup(tmp_path_factory.mktemp("lora"))


@pytest.mark.parametrize("cpu_decoder", [True, False])
def test_adapters_mixed_in_one_batch_equal_their_merged_models(setup, cpu_decoder):
    base, folders, refs = setup
    llm = LLM(str(base), dtype="float32", num_kv_blocks=96, block_size=4,
              chunked_prefill_size=8, max_input_tokens_per_step=24, max_loras=3,
              lora_modules=[f"{n}={p}" for n, p in folders.items()],
              cpu_decoder=cpu_decoder)
    assert (llm.engine.runner.decoder is not None) == cpu_decoder
    jobs = [(name, i) for i in range(len(PROMPTS)) for name in [None, *folders]]
    assert run(llm, jobs) == [refs[name][i] for name, i in jobs]
    # again, reversed: prompts now hit the cache, each under its own adapter's blocks
    hits = llm.engine.scheduler.prefix_hit_tokens
    assert run(llm, jobs[::-1]) == [refs[name][i] for name, i in jobs[::-1]]
    assert llm.engine.scheduler.prefix_hit_tokens > hits


class ScriptedProposer:
    """Guesses the merged models' greedy continuation of a sequence (the first adapter's
    whose tokens so far agree), its second guess wrong at every other position: accepted
    runs and rejections under every adapter, which random weights seldom give a real
    proposer."""

    def __init__(self, refs: list[tuple[list[int], list[int]]]) -> None:
        self.refs = refs

    def propose(self, seq_id, prompt, output, k):
        for p, tokens in self.refs:
            if p == prompt and tokens[:len(output)] == output:
                guess = list(tokens[len(output):len(output) + k])
                if len(output) % 2 and len(guess) > 1:
                    guess[1] += 1
                return GuessTree.chain(guess)
        return GuessTree()

    def forget(self, seq_id, output, finished):
        pass


@pytest.mark.parametrize("cpu_decoder", [True, False])
def test_speculative_rows_take_their_requests_adapter(setup, cpu_decoder):
    """A verification's 1 + k rows run under the request's adapter, beside other adapters'
    and the base model's requests: the tokens (and their logprobs) stay the merged models'."""
    base, folders, refs = setup
    llm = LLM(str(base), dtype="float32", num_kv_blocks=96, block_size=4, max_loras=3,
              lora_modules=[f"{n}={p}" for n, p in folders.items()], cpu_decoder=cpu_decoder,
              speculative_method="ngram", num_speculative_tokens=3, speculative_adaptive=False)
    llm.engine.runner.guesser.proposer = ScriptedProposer(
        [(PROMPTS[i], refs[name][i]) for name in [None, *folders] for i in range(len(PROMPTS))])
    jobs = [(name, i) for i in range(len(PROMPTS)) for name in [None, *folders]]
    assert run(llm, jobs) == [refs[name][i] for name, i in jobs]
    spec = llm.engine.scheduler.spec
    assert spec.accepted_tokens > 40 and spec.drafted_tokens > spec.accepted_tokens


def test_two_slots_for_three_adapters_and_a_small_cpu_cache(setup):
    """Fewer slots than adapters: the scheduler holds two adapters at a time and the runner
    swaps slots (and reloads from disk, with one adapter cached) without mixing them up."""
    base, folders, refs = setup
    llm = LLM(str(base), dtype="float32", num_kv_blocks=96, block_size=4, max_loras=2,
              max_cpu_loras=2, lora_modules=[f"{n}={p}" for n, p in folders.items()])
    jobs = [(name, i) for name in [*folders, None] for i in range(len(PROMPTS))]
    assert run(llm, jobs) == [refs[name][i] for name, i in jobs]
    assert len(llm.engine.runner.lora.loaded) <= 2


def test_bfloat16_slots_under_a_float32_model(setup):
    """--lora-dtype bfloat16: the slots hold the adapters rounded to bfloat16, and a step
    gives the tokens and logprobs of the merged models of those rounded weights."""
    base, folders, refs = setup
    llm = LLM(str(base), dtype="float32", num_kv_blocks=96, block_size=4, max_loras=3,
              lora_dtype="bfloat16", lora_modules=[f"{n}={p}" for n, p in folders.items()])
    pool = llm.engine.runner.lora.pool
    assert {w.a.dtype for ws in pool.layers for w in ws.values()} == {torch.bfloat16}
    jobs = [(name, i) for i in range(len(PROMPTS)) for name in folders]
    params = [SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, lora=name,
                             logprobs=0) for name, _ in jobs]
    outs = llm.generate([{"prompt_token_ids": PROMPTS[i]} for _, i in jobs], params,
                        use_tqdm=False)
    models = {name: merged_model(base, folder, bf16=True) for name, folder in folders.items()}
    for (name, i), o in zip(jobs, outs):
        tokens = hf_greedy(models[name], PROMPTS[i], MAX_TOKENS, None)
        assert o.outputs[0].token_ids == tokens
        got = torch.tensor([lp.logprob for lp in o.outputs[0].logprobs])
        want = token_logprobs(models[name], PROMPTS[i], tokens)[range(len(tokens)), tokens]
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    with pytest.raises(ValueError, match="lora_dtype"):
        LLM(str(base), dtype="float32", num_kv_blocks=16, lora_dtype="float16",
            enable_lora=True)


def test_a_float16_model_serves_adapters(setup):
    """float16 rows (which the C++ kernels do not take) add the deltas by matmuls: base and
    adapter rows in one batch, each token the merged model's choice or within float16's
    rounding of it (teacher-forced through the float32 merged model)."""
    base, folders, _ = setup
    llm = LLM(str(base), dtype="float16", num_kv_blocks=96, block_size=4, max_loras=3,
              lora_modules=[f"{n}={p}" for n, p in folders.items()])
    jobs = [(name, i) for i in range(len(PROMPTS)) for name in [None, *folders]]
    params = [SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, lora=name)
              for name, _ in jobs]
    outs = llm.generate([{"prompt_token_ids": PROMPTS[i]} for _, i in jobs], params,
                        use_tqdm=False)
    models = {name: merged_model(base, folders.get(name)) for name in [None, *folders]}
    for (name, i), o in zip(jobs, outs):
        got = o.outputs[0].token_ids
        assert len(got) == MAX_TOKENS
        lp = token_logprobs(models[name], PROMPTS[i], got)
        assert (lp.max(-1).values - lp[range(len(got)), got]).max() < 0.05


def test_an_unknown_adapter_is_refused_by_name(setup):
    base, folders, _ = setup
    llm = LLM(str(base), dtype="float32", num_kv_blocks=32,
              lora_modules=[f"qv4={folders['qv4']}"])
    with pytest.raises(ValueError, match="unknown LoRA adapter 'nope'"):
        run(llm, [("nope", 0)])
    plain = LLM(str(base), dtype="float32", num_kv_blocks=32)
    with pytest.raises(ValueError, match="LoRA is not enabled"):
        run(plain, [("qv4", 0)])
    assert not llm.engine.has_unfinished_requests()


def edit_config(folder, tmp, **changes):
    import shutil
    out = tmp / f"edited{len(list(tmp.iterdir()))}"
    shutil.copytree(folder, out)
    cfg = json.loads((out / "adapter_config.json").read_text())
    cfg.update(changes)
    (out / "adapter_config.json").write_text(json.dumps(cfg))
    return out


@pytest.mark.parametrize("changes, message", [
    (dict(use_dora=True), "DoRA"),
    (dict(target_modules=["q_proj", "lm_head"]), "the LM head"),
    (dict(target_modules=["embed_tokens"]), "the embeddings"),
    (dict(bias="all"), "biases"),
    (dict(modules_to_save=["lm_head"]), "modules saved whole"),
    (dict(peft_type="PREFIX_TUNING"), "not LORA"),
])
def test_adapters_tidal_cannot_serve_are_refused_by_name(setup, tmp_path, changes, message):
    base, folders, _ = setup
    bad = edit_config(folders["all8"], tmp_path, **changes)
    with pytest.raises(LoRAError, match=message):
        LLM(str(base), dtype="float32", num_kv_blocks=16, lora_modules=[f"bad={bad}"])


def test_a_rank_over_the_limit_a_missing_folder_and_another_models_adapter(setup, tmp_path):
    base, folders, _ = setup
    with pytest.raises(LoRAError, match="rank 16 .* over max_lora_rank=8"):
        LLM(str(base), dtype="float32", num_kv_blocks=16, max_lora_rank=8,
            lora_modules=[f"big={folders['mlp16']}"])
    with pytest.raises(LoRAError, match="'gone'.* is not a folder"):
        LLM(str(base), dtype="float32", num_kv_blocks=16,
            lora_modules=[f"gone={tmp_path / 'nothing'}"])
    wider = small_folder(tmp_path, "wider", "llama", hidden_size=96)
    other = make_adapter(wider, tmp_path / "other", 4, 8, ["q_proj"], False, seed=9)
    with pytest.raises(LoRAError, match="do not fit the model"):
        LLM(str(base), dtype="float32", num_kv_blocks=16, lora_modules=[f"other={other}"])


def test_served_adapters_over_http_with_the_openai_client(setup, tmp_path):
    """`model` picks the adapter; /v1/models lists them with their parent; adapters load and
    unload at run time behind the API key; bad names and folders are 4xx naming them."""
    import httpx
    import openai
    from tokenizers import Tokenizer

    from server_fixtures import Server, openai_client

    base, folders, refs = setup
    text = Tokenizer.from_file(str(base / "tokenizer.json")).decode
    server = Server("--model", str(base), "--dtype", "float32", "--max-loras", "2",
                    "--lora-modules", f"qv4={folders['qv4']}", f"all8={folders['all8']}",
                    "--enable-lora-runtime-updates", "--api-key", "k")
    try:
        client = openai_client(server, "k")
        auth = {"authorization": "Bearer k"}

        def complete(model, i):
            out = client.completions.create(model=model, prompt=PROMPTS[i], max_tokens=MAX_TOKENS,
                                            temperature=0, extra_body={"ignore_eos": True})
            return out.choices[0].text

        cards = {m.id: m for m in client.models.list().data}
        assert set(cards) == {"base", "qv4", "all8"}  # the folder's name is the model's
        assert cards["qv4"].parent == "base" and cards["qv4"].root == str(folders["qv4"])
        for name in ("base", "qv4", "all8"):
            ref = refs[None if name == "base" else name]
            assert [complete(name, i) for i in range(3)] == [text(t) for t in ref[:3]]
        with pytest.raises(openai.NotFoundError, match="'nope' does not exist"):
            complete("nope", 0)

        def post(path, **body):
            return httpx.post(server.url + path, json=body, headers=auth, timeout=30)
        assert httpx.post(server.url + "/v1/load_lora_adapter", timeout=30,
                          json={"lora_name": "x", "lora_path": "y"}).status_code == 401
        r = post("/v1/load_lora_adapter", lora_name="mlp16", lora_path=str(folders["mlp16"]))
        assert r.status_code == 200 and "mlp16" in r.text
        assert complete("mlp16", 1) == text(refs["mlp16"][1])
        assert client.models.retrieve("mlp16").parent == "base"
        r = post("/v1/load_lora_adapter", lora_name="mlp16", lora_path=str(folders["mlp16"]))
        assert r.status_code == 400 and "already been loaded" in r.json()["error"]["message"]
        r = post("/v1/load_lora_adapter", lora_name="bad", lora_path=str(tmp_path))
        assert r.status_code == 400 and "'bad'" in r.json()["error"]["message"]
        assert r.json()["error"]["param"] == "lora_path"
        assert post("/v1/unload_lora_adapter", lora_name="mlp16").status_code == 200
        with pytest.raises(openai.NotFoundError, match="'mlp16' does not exist"):
            complete("mlp16", 1)
        r = post("/v1/unload_lora_adapter", lora_name="mlp16")
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        assert complete("all8", 2) == text(refs["all8"][2])  # the others still serve
        schema = httpx.get(server.url + "/openapi.json", headers=auth).json()
        model = schema["components"]["schemas"]["CompletionRequest"]["properties"]["model"]
        assert "enum" not in str(model)  # adapters come and go: any name may be one
        metrics = httpx.get(server.url + "/metrics", headers=auth).text
        assert 'tidal:lora_requests_total{lora_name="qv4"' in metrics
        assert "tidal:lora_requests_info{" in metrics and 'max_lora="2"' in metrics
    finally:
        log = server.stop()
    assert "Traceback" not in log, log


def test_offline_lora_request_loads_an_adapter_on_first_use(setup):
    """vLLM's offline form: LLM(enable_lora=True), generate(..., lora_request=LoRARequest)."""
    from tidal import LoRARequest

    base, folders, refs = setup
    llm = LLM(str(base), dtype="float32", num_kv_blocks=64, enable_lora=True, max_loras=2)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS[:2]]
    outs = llm.generate(prompts, params, use_tqdm=False,
                        lora_request=LoRARequest("mlp16", 1, str(folders["mlp16"])))
    assert [o.outputs[0].token_ids for o in outs] == refs["mlp16"][:2]
    outs = llm.generate(prompts, params, use_tqdm=False, lora_request=["mlp16", None])
    assert [o.outputs[0].token_ids for o in outs] == [refs["mlp16"][0], refs[None][1]]
    with pytest.raises(ValueError, match="2 LoRA requests for 1 prompts"):
        llm.generate(prompts[:1], params, lora_request=["mlp16", None])


def equals_merged(base, folder):
    """tidal's greedy tokens under the adapter in `folder` equal its merged model's on three
    prompts; returns the adapter as tidal loaded it."""
    merged = merged_model(base, folder)
    want = [hf_greedy(merged, p, MAX_TOKENS, None) for p in PROMPTS[:3]]
    llm = LLM(str(base), dtype="float32", num_kv_blocks=64, lora_modules=[f"it={folder}"])
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, lora="it")
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:3]], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want
    return llm.engine.runner.lora.loaded["it"]


def test_an_attention_adapter_on_a_mixture_of_experts_model(tmp_path):
    """Mixtral: adapters reach the attention of expert layers (their MLP is routed
    experts, which tidal refuses to adapt)."""
    base = small_folder(tmp_path, "moe", "mixtral", num_local_experts=4, num_experts_per_tok=2)
    folder = make_adapter(base, tmp_path / "attn", 8, 16, ["q_proj", "v_proj", "o_proj"],
                          False, seed=5)
    adapter = equals_merged(base, folder)
    assert (1, "gate_up") not in adapter.weights


def test_the_schema_names_the_model_and_its_adapters():
    """Without run-time updates `model` takes the served model's name or an adapter's."""
    from tidal.server.openapi import corrected

    body = {"additionalProperties": False, "properties": {"model": {"type": "string"}}}
    raw = {"paths": {}, "components": {"schemas": {"CompletionRequest": body}}}
    model = corrected(raw, ["base", "qv4"], False)["components"]["schemas"][
        "CompletionRequest"]["properties"]["model"]
    assert model["anyOf"][0]["enum"] == ["base", "qv4"]


def test_a_phi3_adapter_of_the_fused_projections(tmp_path):
    """Phi-3 fuses q/k/v and gate/up in its checkpoints: an adapter on `qkv_proj` and
    `gate_up_proj` is one piece per part of tidal's projections, each with the whole A."""
    base = small_folder(tmp_path, "phi3", "phi3", sliding_window=12,
                        rope_parameters=dict(rope_type="default", rope_theta=10000.0,
                                             partial_rotary_factor=0.5))
    folder = make_adapter(base, tmp_path / "fused", 8, 16,
                          ["qkv_proj", "gate_up_proj", "o_proj", "down_proj"], False, seed=7)
    adapter = equals_merged(base, folder)
    assert [part for part, _, _ in adapter.weights[(0, "qkv")]] == [0, 1, 2]


def test_a_granite_adapter_under_its_folded_multipliers(tmp_path):
    """Granite's residual multiplier is folded into o_proj and down_proj at load: an
    adapter's deltas on them are scaled alike, or its answers would leave the merged
    model's (they do with the adapter's scale alone)."""
    from test_models import GRANITE

    base = small_folder(tmp_path, "granite", "granite", tie_word_embeddings=True, **GRANITE)
    folder = make_adapter(base, tmp_path / "ad", 8, 16, ["q_proj", "o_proj", "down_proj"],
                          False, seed=9)
    equals_merged(base, folder)


def test_lora_modules_take_name_path_pairs_and_vllms_json_form():
    from tidal.engine.config import LoRAConfig

    json_entry = '{"name": "sql", "path": "/a/sql", "base_model_name": "m"}'
    assert LoRAConfig(lora_modules=["chat=/a/chat", json_entry]).modules == {
        "chat": "/a/chat", "sql": "/a/sql"}
    assert LoRAConfig(lora_modules="x=/1,y=/2").modules == {"x": "/1", "y": "/2"}
    assert LoRAConfig(lora_modules=json_entry).enable_lora
    for bad, message in (("noequals", "name=path"), ('{"name": "a"}', "JSON"),
                         (["a=/1", "a=/2"], "twice")):
        with pytest.raises(ValueError, match=message):
            LoRAConfig(lora_modules=bad)


def test_a_new_adapter_takes_the_slot_used_longest_ago(setup):
    base, folders, _ = setup
    llm = LLM(str(base), dtype="float32", num_kv_blocks=16, max_loras=2,
              lora_modules=[f"{n}={p}" for n, p in folders.items()])
    lora, writes = llm.engine.runner.lora, []
    write = lora.pool.write
    lora.pool.write = lambda slot, adapter: writes.append((slot, adapter.name)) or write(
        slot, adapter)
    assert lora.prepare(["qv4"]) == {"qv4": 0}
    assert lora.prepare(["all8"]) == {"all8": 1}
    assert lora.prepare(["qv4"]) == {"qv4": 0}  # resident: no write
    assert lora.prepare(["mlp16"]) == {"mlp16": 1}  # all8's slot: used longest ago
    assert lora.prepare(["qv4", "all8"]) == {"qv4": 0, "all8": 1}
    assert writes == [(0, "qv4"), (1, "all8"), (1, "mlp16"), (1, "all8")]
