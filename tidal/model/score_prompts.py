"""How a (query, document) pair becomes the prompt a score head reads
(tidal/model/score_head.py), for /v1/score, /v1/rerank and `LLM.score` alike; torch-free, so
the server's process reads it too.

- a classifier (a `*ForSequenceClassification` checkpoint): the tokenizer's pair encoding;
- answer tokens (an LLM reranker, `--score-tokens no,yes`): a judging prompt through the
  model's chat template, Qwen3-Reranker's recipe (a system line, then `<Instruct>`,
  `<Query>` and `<Document>`), thinking off."""

from __future__ import annotations

from typing import Sequence

from tidal.core import SamplingParams

JUDGE = ('Judge whether the Document meets the requirements based on the Query and the '
         'Instruct provided. Note that the answer can only be "yes" or "no".')
INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"


def pair_ids(tokenizer, scorer: str, query: str, document: str, instruction: str | None
             ) -> list[int]:
    """The prompt that scores `document` against `query` for a head of kind `scorer`."""
    if scorer == "answer_tokens":
        user = (f"<Instruct>: {instruction or INSTRUCTION}\n<Query>: {query}\n"
                f"<Document>: {document}")
        if tokenizer.chat_template is None:  # no template to wrap it: the lines alone
            return tokenizer.encode(f"{JUDGE}\n{user}\n")
        text = tokenizer.apply_chat_template(
            [{"role": "system", "content": JUDGE}, {"role": "user", "content": user}],
            add_generation_prompt=True, enable_thinking=False)
        return tokenizer.encode(text, add_special_tokens=False)
    return tokenizer.encode_pair(query, document)


def score_pairs(first: str | Sequence[str], second: str | Sequence[str]
                ) -> list[tuple[str, str]]:
    """vLLM's pairing: one first text against each second one, or pair by pair (lists of
    one length)."""
    firsts = [first] if isinstance(first, str) else list(first)
    seconds = [second] if isinstance(second, str) else list(second)
    if len(firsts) not in (1, len(seconds)):
        raise ValueError(f"{len(firsts)} first texts for {len(seconds)} second ones: one, "
                         "or as many")
    return list(zip(firsts * len(seconds) if len(firsts) == 1 else firsts, seconds))


def score_params() -> SamplingParams:
    """A scoring request's: it ends at its prompt, with the score head's reading."""
    return SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, embed=0, score=True)
