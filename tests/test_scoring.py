"""Scores and reranking: the bodies' pairs and answers; a sequence-classification
checkpoint's head and an LLM reranker's answer tokens scoring as transformers computes
them; and served, /v1/score and /v1/rerank (and their aliases) on a classifier, batched
with generation, `--task score`, and refusals; offline, `LLM.score`; a classifier of several
labels through `LLM.classify` and `/classify`."""

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


@pytest.fixture(scope="module")
def three_labels(tmp_path_factory, classifier):
    """A tiny random classifier of three named labels."""
    from transformers import AutoConfig, LlamaForSequenceClassification

    folder = tmp_path_factory.mktemp("three") / "cls3"
    cfg = AutoConfig.for_model("llama", **{**SMALL, "num_labels": 3}, id2label={
        0: "negative", 1: "neutral", 2: "positive"})
    torch.manual_seed(5)
    model = LlamaForSequenceClassification(cfg).float().eval()
    model.save_pretrained(str(folder))
    shutil.copy(classifier[0] / "tokenizer.json", folder / "tokenizer.json")
    return folder, model, classifier[2]


def hf_probs(model, tok, texts) -> list[list[float]]:
    with torch.no_grad():
        return [torch.softmax(model(torch.tensor([tok.encode(t).ids])).logits[0], 0).tolist()
                for t in texts]


def test_a_classifier_of_several_labels_classifies_offline_and_served(three_labels):
    from tidal import LLM

    folder, model, tok = three_labels
    want = hf_probs(model, tok, DOCS)
    llm = LLM(str(folder), num_kv_blocks=32, num_threads=1, dtype="float32")
    try:
        assert llm.classifier_labels == ("negative", "neutral", "positive")
        got = llm.classify(DOCS)
        for g, w in zip(got, want):
            assert g == pytest.approx(w, abs=1e-5)
        with pytest.raises(ValueError, match="classifies into 3 labels.*LLM.classify"):
            llm.score(QUERY, DOCS)
    finally:
        llm.close()
    server = Server("--model", str(folder), "--dtype", "float32")
    try:
        for path in ("/classify", "/v1/classify"):
            r = httpx.post(server.url + path, json={"input": DOCS}).json()
            assert [d["index"] for d in r["data"]] == [0, 1, 2, 3]
            for d, w in zip(r["data"], want):
                assert d["probs"] == pytest.approx(w, abs=1e-5) and d["num_classes"] == 3
                assert d["label"] == ("negative", "neutral", "positive")[w.index(max(w))]
            assert r["usage"]["prompt_tokens"] == sum(len(tok.encode(t).ids) for t in DOCS)
        ids = tok.encode(DOCS[1]).ids
        one = httpx.post(server.url + "/classify", json={"input": ids}).json()["data"]
        assert one[0]["probs"] == pytest.approx(want[1], abs=1e-5)
        cut = httpx.post(server.url + "/classify", json={"input": DOCS[1],
                                                         "truncate_prompt_tokens": 2}).json()
        assert cut["usage"]["prompt_tokens"] == 2
        pairs = httpx.post(server.url + "/v1/score", json={"text_1": QUERY, "text_2": DOCS})
        assert pairs.status_code == 400 and "POST /classify" in pairs.text
        empty = httpx.post(server.url + "/classify", json={"input": []})
        assert empty.status_code == 400 and empty.json()["error"]["param"] == "input"
    finally:
        server.stop()


def test_classify_needs_a_classifier_head(classifier):
    from tidal import LLM

    reranker = LLM(str(small_folder(classifier[0].parent, "lm2", "llama")), num_kv_blocks=16,
                   num_threads=1, score_tokens="w4,w6")
    with pytest.raises(ValueError, match="classify reads a .*ForSequenceClassification"):
        reranker.classify("w5 w9")
    folder, model, tok = classifier  # one label: its sigmoid, as /v1/score reads it
    one = LLM(str(folder), num_kv_blocks=16, num_threads=1, dtype="float32")
    with torch.no_grad():
        want = float(torch.sigmoid(model(torch.tensor([tok.encode(QUERY).ids])).logits[0, 0]))
    assert one.classify([QUERY])[0] == pytest.approx([want], abs=1e-5)


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
