"""Embeddings: the pooling read from a folder's sentence-transformers files, `LLM.embed`
equal to transformers' pooled last hidden state (last-token, mean and CLS pooling, over
chunked prefills, beside generation in one batch, Matryoshka dimensions), and
`/v1/embeddings` end to end with the official client (floats and base64, token ids,
dimensions refused where the model cannot give them, beside chat traffic)."""

from __future__ import annotations

import json
import threading

import httpx
import openai
import pytest
import torch
import torch.nn.functional as F

from model_fixtures import tiny_folder
from server_fixtures import Server, openai_client
from tidal import LLM, SamplingParams
from tidal.model.pooling import Pooling

TEXTS = ["The capital of France is Paris, a large city on the Seine with many old bridges.",
         "hi", "Embeddings of a tiny random model still have to match."]


def sentence_transformers_files(folder, mode: str | None, normalize: bool, **config) -> None:
    """modules.json with a Pooling module of `mode` (None: no modules.json), a Normalize
    module if `normalize`; extra keys merged into config.json."""
    if config:
        cfg = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**cfg, **config}))
    if mode is None:
        return
    modules = [{"idx": 0, "name": "0", "path": "",
                "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling",
                "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize",
                        "type": "sentence_transformers.models.Normalize"})
    (folder / "modules.json").write_text(json.dumps(modules))
    (folder / "1_Pooling").mkdir()
    key = {"last": "pooling_mode_lasttoken", "mean": "pooling_mode_mean_tokens",
           "cls": "pooling_mode_cls_token"}[mode]
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": 64, key: True, "pooling_mode_max_tokens": False}))


def reference(folder, ids: list[int], mode: str, normalize: bool, dims: int = 0) -> torch.Tensor:
    """transformers' last hidden state (after the final norm), pooled."""
    from transformers import AutoModel

    model = AutoModel.from_pretrained(str(folder), dtype=torch.float32)
    with torch.no_grad():
        h = model(torch.tensor([ids])).last_hidden_state[0]
    v = {"last": h[-1], "cls": h[0], "mean": h.mean(0)}[mode]
    v = v[:dims] if dims else v
    return F.normalize(v, dim=0) if normalize else v


def test_the_pooling_comes_from_the_folder(tmp_path):
    assert Pooling.from_folder(None) == Pooling("last", True, False)
    for i, (mode, normalize) in enumerate((("mean", True), ("cls", False), ("last", True))):
        folder = tmp_path / str(i)
        folder.mkdir()
        (folder / "config.json").write_text("{}")
        sentence_transformers_files(folder, mode, normalize, matryoshka_dimensions=[32, 64])
        assert Pooling.from_folder(folder) == Pooling(mode, normalize, True)
    conf = tmp_path / "0" / "1_Pooling" / "config.json"
    conf.write_text(json.dumps({"pooling_mode_max_tokens": True}))
    with pytest.raises(ValueError, match="pooling_mode_max_tokens"):
        Pooling.from_folder(tmp_path / "0")


@pytest.mark.parametrize("mode, normalize", [(None, True), ("mean", True), ("cls", False)])
def test_llm_embed_equals_transformers_pooled_hidden_state(tmp_path, mode, normalize):
    """Chunks of 16 tokens (the pooling folds them in), and a generation request in the same
    batch that gets the same tokens as alone."""
    folder = tiny_folder(tmp_path, "qwen3")
    sentence_transformers_files(folder, mode, normalize)
    llm = LLM(str(folder), dtype="float32", num_kv_blocks=64, chunked_prefill_size=16)
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    alone = llm.generate(TEXTS[2], greedy, use_tqdm=False)[0].outputs[0].token_ids
    embed = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True, embed=0)
    both = llm.generate([TEXTS[0], TEXTS[2], TEXTS[1]], [embed, greedy, embed],
                        use_tqdm=False)
    assert both[1].outputs[0].token_ids == alone and both[1].embedding is None
    for text, out in zip((TEXTS[0], TEXTS[1]), (both[0], both[2])):
        want = reference(folder, llm.engine.tokenize(text), mode or "last", normalize)
        got = torch.tensor(out.embedding)
        assert got.shape == want.shape and F.cosine_similarity(got, want, dim=0) > 0.999
        assert torch.allclose(got, want, atol=1e-4)
    assert len(llm.engine.tokenize(TEXTS[0])) > 16  # several chunks


def test_matryoshka_dimensions_truncate_then_normalise(tmp_path):
    folder = tiny_folder(tmp_path, "qwen3")
    sentence_transformers_files(folder, "mean", True, matryoshka_dimensions=[16, 64])
    llm = LLM(str(folder), dtype="float32", num_kv_blocks=64)
    got = torch.tensor(llm.embed(TEXTS[0], dimensions=16)[0])
    want = reference(folder, llm.engine.tokenize(TEXTS[0]), "mean", True, dims=16)
    assert got.shape == (16,) and torch.allclose(got, want, atol=1e-4)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    folder = tiny_folder(tmp_path_factory.mktemp("embed"), "qwen3")
    sentence_transformers_files(folder, "mean", True)
    server = Server("--model", str(folder), "--dtype", "float32", "--chunked-prefill-size", "16")
    yield server, folder
    server.stop()


def test_embeddings_endpoint_equals_the_reference(served):
    server, folder = served
    client = openai_client(server)
    name = client.models.list().data[0].id
    tokens = [httpx.post(server.url + "/tokenize", json={"prompt": t}).json()["tokens"]
              for t in TEXTS]
    got = client.embeddings.create(model=name, input=TEXTS)  # the client asks for base64
    assert [d.index for d in got.data] == [0, 1, 2]
    assert got.usage.prompt_tokens == got.usage.total_tokens == sum(map(len, tokens))
    for d, ids in zip(got.data, tokens):
        want = reference(folder, ids, "mean", True)
        assert F.cosine_similarity(torch.tensor(d.embedding), want, dim=0) > 0.999
    floats = httpx.post(server.url + "/v1/embeddings", json={
        "model": name, "input": tokens, "encoding_format": "float"}).json()
    for d, e in zip(got.data, floats["data"]):
        assert torch.allclose(torch.tensor(d.embedding), torch.tensor(e["embedding"]),
                              atol=1e-6)
    one = client.embeddings.create(model=name, input=tokens[1])
    assert torch.allclose(torch.tensor(one.data[0].embedding),
                          torch.tensor(got.data[1].embedding), atol=1e-6)
    # vLLM's truncate_prompt_tokens: an input's last k tokens, as if sent alone
    tail = client.embeddings.create(model=name, input=TEXTS[2],
                                    extra_body={"truncate_prompt_tokens": 3})
    alone = client.embeddings.create(model=name, input=tokens[2][-3:])
    assert tail.usage.prompt_tokens == 3
    assert torch.allclose(torch.tensor(tail.data[0].embedding),
                          torch.tensor(alone.data[0].embedding), atol=1e-6)


def test_embeddings_and_chat_share_the_engine(served):
    server, _ = served
    client = openai_client(server)
    name = client.models.list().data[0].id
    results, errors = [], []

    def run(fn):
        try:
            results.append(fn())
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    jobs = [lambda: client.completions.create(model=name, prompt=TEXTS[0], max_tokens=24,
                                              temperature=0)] * 2 + \
        [lambda: client.embeddings.create(model=name, input=TEXTS)] * 3
    threads = [threading.Thread(target=run, args=(j,)) for j in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(results) == 5
    embeddings = [r for r in results if r.object == "list"]
    assert all(len(r.data) == 3 for r in embeddings)
    assert all(torch.allclose(torch.tensor(r.data[0].embedding),
                              torch.tensor(embeddings[0].data[0].embedding), atol=1e-5)
               for r in embeddings)


def test_a_conversation_is_embedded_through_the_chat_template(served):
    """vLLM's chat embeddings: `messages` embed as the template's render of them (no
    generation prompt, no added special tokens by default) sent as token ids."""
    server, _ = served
    chat = [{"role": "system", "content": "Embed this."}, {"role": "user", "content": TEXTS[0]}]
    rendered = httpx.post(server.url + "/tokenize", json={
        "messages": chat, "add_generation_prompt": False}).json()["tokens"]

    def vector(body):
        r = httpx.post(server.url + "/v1/embeddings", json={**body, "encoding_format": "float"})
        assert r.status_code == 200, r.text
        return r.json()

    got = vector({"messages": chat})
    assert got["usage"]["prompt_tokens"] == len(rendered)
    want = vector({"input": rendered})["data"][0]["embedding"]
    assert torch.allclose(torch.tensor(got["data"][0]["embedding"]), torch.tensor(want),
                          atol=1e-6)
    prompted = vector({"messages": chat, "add_generation_prompt": True})
    assert prompted["usage"]["prompt_tokens"] > len(rendered)


@pytest.mark.parametrize("body, param", [
    ({"input": "a", "messages": [{"role": "user", "content": "a"}]}, "input"),
    ({}, "input"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "user", "content": "a"}], "chat_template": "{{ 1 }}"},
     "chat_template"),
    ({"input": []}, "input"),
    ({"input": ""}, "input"),
    ({"input": [[1, 2], [10 ** 9]]}, "input"),
    ({"input": "a", "dimensions": 16}, "dimensions"),  # not a Matryoshka model
    ({"input": "a", "dimensions": 65}, "dimensions"),
    ({"input": "a", "encoding_format": "int8"}, "encoding_format"),
    ({"input": "a", "temperature": 0}, "temperature"),
])
def test_bad_embedding_requests_are_400s_naming_the_field(served, body, param):
    server, _ = served
    r = httpx.post(server.url + "/v1/embeddings", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_an_unknown_model_is_refused_as_in_chat(served):
    server, _ = served
    with pytest.raises(openai.NotFoundError) as err:
        openai_client(server).embeddings.create(model="nope", input="a")
    assert err.value.body["code"] == "model_not_found"


def test_a_bare_body_checkpoint_loads_for_embeddings(tmp_path):
    """Embedding checkpoints (Qwen3-Embedding's) hold the body alone: no `model.` prefix and
    no LM head. They load (the head tied to the embeddings) and embed as transformers."""
    from transformers import AutoModel

    folder = tiny_folder(tmp_path, "qwen3")
    body = AutoModel.from_pretrained(str(folder), dtype=torch.float32)
    bare = tmp_path / "bare"
    body.save_pretrained(str(bare))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (bare / name).write_bytes((folder / name).read_bytes())
    from safetensors import safe_open
    with safe_open(str(next(bare.glob("*.safetensors"))), "pt") as f:
        assert not any(k.startswith(("model.", "lm_head")) for k in f.keys())
    llm = LLM(str(bare), dtype="float32", num_kv_blocks=64)
    got = torch.tensor(llm.embed(TEXTS[2])[0])
    want = reference(bare, llm.engine.tokenize(TEXTS[2]), "last", True)
    assert torch.allclose(got, want, atol=1e-4)


def test_a_granite_model_embeds_the_states_before_its_folded_multipliers(tmp_path):
    """Granite's final norm holds 1 / (logits_scaling * embedding_multiplier) once loaded
    (tied head): the hidden states pooled for embeddings are transformers' GraniteModel's
    all the same (mean-pooled and unnormalised here, so a scale would show)."""
    from model_fixtures import small_folder
    from test_models import GRANITE

    folder = small_folder(tmp_path, "granite", "granite", tie_word_embeddings=True, **GRANITE)
    sentence_transformers_files(folder, "mean", False)
    llm = LLM(str(folder), dtype="float32", num_kv_blocks=64)
    text = "w5 w17 w3 w99 w42 w8"
    got = torch.tensor(llm.embed(text)[0])
    want = reference(folder, llm.engine.tokenize(text), "mean", False)
    assert torch.allclose(got, want, atol=1e-4)


def test_an_embed_server_refuses_generation_and_a_generate_one_embeddings(tmp_path):
    folder = tiny_folder(tmp_path, "qwen3")
    for task, refused, served in (("embed", "/v1/chat/completions", "/v1/embeddings"),
                                  ("generate", "/v1/embeddings", "/v1/completions")):
        server = Server("--model", str(folder), "--dtype", "float32", "--task", task)
        try:
            body = {"input": "a", "prompt": "a", "messages": [{"role": "user", "content": "a"}],
                    "max_tokens": 2}
            keys = {"/v1/embeddings": ("input",), "/v1/completions": ("prompt", "max_tokens"),
                    "/v1/chat/completions": ("messages", "max_tokens")}
            r = httpx.post(server.url + refused, json={k: body[k] for k in keys[refused]})
            assert r.status_code == 400 and r.json()["error"]["code"] == "unsupported_task"
            assert f"--task {task}" in r.json()["error"]["message"]
            ok = httpx.post(server.url + served, json={k: body[k] for k in keys[served]})
            assert ok.status_code == 200, ok.text
            if task == "embed":
                r = httpx.post(server.url + "/v1/responses", json={"input": "a"})
                assert r.status_code == 400 and r.json()["error"]["code"] == "unsupported_task"
        finally:
            server.stop()
