"""Scores and reranking: the bodies' pairs and answers; a sequence-classification
checkpoint's head and an LLM reranker's answer tokens scoring as transformers computes
them; and served, /v1/score and /v1/rerank (and their aliases) on a classifier, batched
with generation, `--task score`, and refusals; offline, `LLM.score`."""

from __future__ import annotations

import asyncio
import shutil

import httpx
import pytest
import torch

from model_fixtures import SMALL, small_folder
from server_fixtures import Server
from tidal.model.score_head import classifier_tokens
from tidal.server.scoring import RerankRequest, ScoreRequest

QUERY = "w5 w9 w33"
DOCS = ["w7 w100 w3", "w5 w9 w34 w8", "w200 w201", "w5 w9 w33 w1"]


# ---------------------------------------------------------------------- pure parts

def test_score_pairs_one_text_against_many_or_pair_by_pair():
    assert ScoreRequest(text_1="q", text_2=["a", "b"]).pairs() == [("q", "a"), ("q", "b")]
    assert ScoreRequest(text_1=["q"], text_2=["a", "b"]).pairs() == [("q", "a"), ("q", "b")]
    assert ScoreRequest(text_1=["p", "q"], text_2=["a", "b"]).pairs() == [("p", "a"),
                                                                          ("q", "b")]
    with pytest.raises(ValueError, match="one, or as many as text_2"):
        ScoreRequest(text_1=["p", "q", "r"], text_2=["a", "b"])


def test_rerank_orders_by_relevance_and_keeps_top_n():
    body = RerankRequest(query="q", documents=["a", {"text": "b"}, "c"], top_n=2)
    out = body.body([[0.2], [0.9], [0.5]], [[1, 2], [3], [4]], "m")
    assert [r["index"] for r in out["results"]] == [1, 2]
    assert out["results"][0] == {"index": 1, "relevance_score": 0.9, "document": {"text": "b"}}
    assert out["usage"]["total_tokens"] == 4
    bare = RerankRequest(query="q", documents=["a"], return_documents=False)
    assert "document" not in bare.body([[0.3]], [[1]], "m")["results"][0]
    with pytest.raises(ValueError, match="a document is a text or an object with a text"):
        RerankRequest(query="q", documents=[{"title": "x"}])


def test_answer_tokens_come_from_the_flag_or_the_config(tmp_path):
    (tmp_path / "config.json").write_text('{"classifier_from_token": ["no", "yes"]}')
    assert classifier_tokens(tmp_path, None) == ("no", "yes")
    assert classifier_tokens(tmp_path, "false,true") == ("false", "true")
    assert classifier_tokens(None, None) is None
    with pytest.raises(ValueError, match="two tokens, false then true"):
        classifier_tokens(None, "yes")


# ---------------------------------------------------------------------- on tiny models

@pytest.fixture(scope="module")
def classifier(tmp_path_factory):
    """A tiny random LlamaForSequenceClassification (one label), with a tokenizer whose
    pair encoding joins the two texts."""
    from tokenizers import processors
    from tokenizers import Tokenizer as HFTokenizer
    from transformers import AutoConfig, LlamaForSequenceClassification

    tmp = tmp_path_factory.mktemp("score")
    base = small_folder(tmp, "base", "llama")
    cfg = AutoConfig.for_model("llama", **{**SMALL, "num_labels": 1})
    torch.manual_seed(3)
    model = LlamaForSequenceClassification(cfg).float().eval()
    folder = tmp / "cls"
    model.save_pretrained(str(folder))
    tok = HFTokenizer.from_file(str(base / "tokenizer.json"))
    tok.post_processor = processors.TemplateProcessing(
        single="w1 $A", pair="w1 $A w2 $B", special_tokens=[("w1", 1), ("w2", 2)])
    tok.save(str(folder / "tokenizer.json"))
    return folder, model, tok


def hf_scores(model, tok, pairs) -> list[float]:
    with torch.no_grad():
        return [float(torch.sigmoid(model(torch.tensor([tok.encode(q, d).ids])).logits[0, 0]))
                for q, d in pairs]


def test_an_llm_reranker_scores_by_its_answer_tokens(tmp_path):
    """softmax over (no, yes) at the prompt's last token, as transformers computes it."""
    from transformers import AutoModelForCausalLM

    from tidal import LLM, SamplingParams

    folder = small_folder(tmp_path, "lm", "llama")
    llm = LLM(str(folder), num_kv_blocks=32, num_threads=1, dtype="float32",
              score_tokens="w4,w6")
    prompts = [[5, 9, 33, 7], [17, 4, 200, 8, 60]]
    got = llm.generate([{"prompt_token_ids": p} for p in prompts],
                       SamplingParams(max_tokens=1, embed=0, score=True), use_tqdm=False)
    llm.close()
    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    for out, ids in zip(got, prompts):
        with torch.no_grad():
            last = hf(torch.tensor([ids])).logits[0, -1]
        want = float(torch.softmax(last[[4, 6]], 0)[1])
        assert out.embedding == pytest.approx([want], abs=1e-5)


def test_served_score_and_rerank_match_the_classifier_and_batch_with_generation(classifier):
    folder, model, tok = classifier
    want = hf_scores(model, tok, [(QUERY, d) for d in DOCS])
    server = Server("--model", str(folder), "--dtype", "float32")
    try:
        score = httpx.post(server.url + "/v1/score",
                           json={"text_1": QUERY, "text_2": DOCS}).json()
        assert [d["index"] for d in score["data"]] == [0, 1, 2, 3]
        assert [d["score"] for d in score["data"]] == pytest.approx(want, abs=1e-5)

        async def together():  # a rerank and a generation at once: one engine core
            async with httpx.AsyncClient(base_url=server.url, timeout=120) as c:
                return await asyncio.gather(
                    c.post("/v1/rerank", json={"query": QUERY, "documents": DOCS, "top_n": 3}),
                    c.post("/v1/completions", json={"prompt": [5, 9, 33], "max_tokens": 8}))

        rerank, completion = asyncio.run(together())
        assert completion.status_code == 200
        results = rerank.json()["results"]
        order = sorted(range(len(DOCS)), key=lambda i: -want[i])[:3]
        assert [r["index"] for r in results] == order
        assert [r["document"]["text"] for r in results] == [DOCS[i] for i in order]
        assert [r["relevance_score"] for r in results] == pytest.approx(
            [want[i] for i in order], abs=1e-5)
        for alias in ("/rerank", "/v2/rerank"):
            again = httpx.post(server.url + alias, json={"query": QUERY, "documents": DOCS})
            assert [r["index"] for r in again.json()["results"]] == \
                sorted(range(len(DOCS)), key=lambda i: -want[i])
        bad = httpx.post(server.url + "/v1/score", json={"text_1": ["a", "b", "c"],
                                                         "text_2": ["x", "y"]})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "text_1"
    finally:
        server.stop()


def test_task_score_serves_scores_only_and_a_model_without_a_head_refuses(classifier):
    folder = classifier[0]
    server = Server("--model", str(folder), "--dtype", "float32", "--task", "score")
    try:
        chat = httpx.post(server.url + "/v1/completions", json={"prompt": "w5", "max_tokens": 2})
        assert chat.status_code == 400 and "scores and reranking only" in chat.text
        ok = httpx.post(server.url + "/v1/rerank", json={"query": QUERY, "documents": DOCS})
        assert ok.status_code == 200
    finally:
        server.stop()
    plain = Server()  # the embedded model: a generator, with no score head
    try:
        r = httpx.post(plain.url + "/v1/rerank", json={"query": "q", "documents": ["d"]})
        assert r.status_code == 400 and "no score head" in r.json()["error"]["message"]
    finally:
        plain.stop()


def test_a_classifier_of_several_labels_is_refused_naming_it(tmp_path, classifier):
    from transformers import AutoConfig, LlamaForSequenceClassification

    from tidal import LLM

    cfg = AutoConfig.for_model("llama", **{**SMALL, "num_labels": 3})
    LlamaForSequenceClassification(cfg).save_pretrained(str(tmp_path / "three"))
    shutil.copy(classifier[0] / "tokenizer.json", tmp_path / "three" / "tokenizer.json")
    with pytest.raises(ValueError, match="a score head of 3 labels"):
        LLM(str(tmp_path / "three"), num_kv_blocks=16, num_threads=1)


def test_offline_score_matches_the_classifier_and_pairs_as_the_server(classifier):
    from tidal import LLM

    folder, model, tok = classifier
    llm = LLM(str(folder), num_kv_blocks=32, num_threads=1, dtype="float32")
    try:
        assert llm.score(QUERY, DOCS) == pytest.approx(
            hf_scores(model, tok, [(QUERY, d) for d in DOCS]), abs=1e-5)
        assert llm.score(DOCS[:2], DOCS[2:]) == pytest.approx(
            hf_scores(model, tok, list(zip(DOCS[:2], DOCS[2:]))), abs=1e-5)
        with pytest.raises(ValueError, match="3 first texts for 2 second ones"):
            llm.score(DOCS[:3], DOCS[:2])
    finally:
        llm.close()
    plain = LLM(str(small_folder(folder.parent, "plain", "llama")), num_kv_blocks=16,
                num_threads=1)
    with pytest.raises(ValueError, match="no score head"):
        plain.score("q", "d")
