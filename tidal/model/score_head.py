"""A relevance score from the final hidden state (after the last norm) of a prompt's last
token, for /v1/score and /v1/rerank:

- a sequence-classification checkpoint (`LlamaForSequenceClassification`,
  `Qwen2ForSequenceClassification`, ...): its one-label linear head, `score.weight`;
- an LLM reranker that answers yes or no (Qwen3-Reranker's recipe): the model's logit of
  the "true" token less the "false" one's, the tokens named by config.json's
  `classifier_from_token` (vLLM's key: `["no", "yes"]`) or `--score-tokens no,yes`.

The score is the sigmoid of that logit: a probability of relevance (for two answer tokens,
their two-way softmax), as vLLM's and Cohere's rerankers report it."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

HEAD = "score.weight"  # a sequence-classification checkpoint's head, [num_labels, hidden]


def classifier_tokens(folder: str | Path | None, flag: str | None) -> tuple[str, str] | None:
    """The (false, true) answer tokens of an LLM reranker: the flag's `no,yes`, else
    config.json's `classifier_from_token`; None for neither."""
    if flag:
        tokens = tuple(t.strip() for t in flag.split(","))
        if len(tokens) != 2 or not all(tokens):
            raise ValueError(f"--score-tokens {flag!r}: two tokens, false then true "
                             f"(e.g. no,yes)")
        return tokens  # type: ignore[return-value]
    config = _config(folder)
    tokens = config.get("classifier_from_token")
    if tokens is not None and (not isinstance(tokens, list) or len(tokens) != 2):
        raise ValueError(f"{folder}: classifier_from_token must name two tokens, false then "
                         f"true (e.g. [\"no\", \"yes\"])")
    return tuple(tokens) if tokens else None


def _config(folder: str | Path | None) -> dict:
    try:
        return json.loads((Path(folder) / "config.json").read_text()) if folder else {}
    except (OSError, ValueError):
        return {}


def _read_head(folder: Path) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """The checkpoint's `score.weight` (and bias, if any), or None for a folder without."""
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            if HEAD in f.keys():
                bias = f.get_tensor("score.bias") if "score.bias" in f.keys() else None
                return f.get_tensor(HEAD).float(), None if bias is None else bias.float()
    return None


class ScoreHead:
    """`logit(hidden)`: one relevance logit from a pooled final hidden state; `score`: its
    sigmoid. `reading` is what a request gets: that score, or for a classifier of several
    labels (`labels`, config.json's id2label) the softmax of its logits (/classify)."""

    def __init__(self, weight: torch.Tensor | None = None, bias: torch.Tensor | None = None,
                 token_ids: tuple[int, int] | None = None, logits=None,
                 dtype: torch.dtype = torch.float32, labels: tuple[str, ...] = ()) -> None:
        self.weight, self.bias, self.token_ids = weight, bias, token_ids
        self._logits, self._dtype = logits, dtype  # the model's LM head, and what it reads
        self.labels = labels  # a classifier's, one per row of `weight`

    @classmethod
    def of(cls, folder: str | Path, model, dtype: torch.dtype, tokenize,
           flag: str | None) -> "ScoreHead | None":
        """The head `folder`'s model (running in `dtype`) scores with (`tokenize`: text ->
        ids, for the answer tokens), or None where it has none."""
        tokens = classifier_tokens(folder, flag)
        if tokens is not None:
            ids = []
            for text in tokens:
                found = tokenize(text)
                if len(found) != 1:
                    raise ValueError(f"score token {text!r} is {len(found)} tokens of this "
                                     f"model's vocabulary, not one")
                ids.append(found[0])
            return cls(token_ids=(ids[0], ids[1]), logits=model.logits, dtype=dtype)
        head = _read_head(Path(folder)) if Path(folder).is_dir() else None
        if head is None:
            return None
        weight, bias = head
        names = _config(folder).get("id2label") or {}
        labels = tuple(str(names.get(str(i), f"LABEL_{i}")) for i in range(weight.shape[0]))
        return cls(weight, bias, labels=labels)

    @property
    def kind(self) -> str:
        """How pairs are written for it: "answer_tokens" (a judging prompt through the chat
        template) or "classifier" (the tokenizer's pair encoding)."""
        return "answer_tokens" if self.token_ids is not None else "classifier"

    def logit(self, hidden: torch.Tensor) -> float:
        if self.token_ids is not None:
            row = self._logits(hidden.reshape(1, -1).to(self._dtype))[0]
            return float(row[self.token_ids[1]] - row[self.token_ids[0]])
        return float(self._head(hidden)[0])

    def _head(self, hidden: torch.Tensor) -> torch.Tensor:
        """The classifier head's logits, one per label."""
        out = self.weight @ hidden.float()
        return out if self.bias is None else out + self.bias

    def score(self, hidden: torch.Tensor) -> float:
        return float(torch.sigmoid(torch.tensor(self.logit(hidden))))

    def reading(self, hidden: torch.Tensor) -> list[float]:
        """What a scoring request gets: [score] of a one-label head (a reranker's, or an
        LLM's answer tokens), a classifier's probability per label (softmax) otherwise."""
        if len(self.labels) <= 1:
            return [self.score(hidden)]
        return torch.softmax(self._head(hidden), 0).tolist()
