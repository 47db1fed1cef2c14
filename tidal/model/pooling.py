"""Embeddings from a decoder's final hidden states (after its last norm), pooled as the
model folder's sentence-transformers files say: `modules.json` names a Pooling module (its
`config.json`: mean, CLS or last-token pooling) and maybe a Normalize one. A folder without
them pools the last token and normalises, as decoder embedding models (Qwen3-Embedding,
e5-mistral) do. A prompt's hidden states come chunk by chunk (chunked prefill): `add` folds
each chunk into the request's state, `finish` makes the vector."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

_MODES = {"pooling_mode_lasttoken": "last", "pooling_mode_cls_token": "cls",
          "pooling_mode_mean_tokens": "mean"}


@dataclass(frozen=True)
class Pooling:
    """`mode` (`last`, `cls` or `mean`), whether the vector is scaled to unit length, and
    whether its leading dimensions are an embedding too (Matryoshka: config.json's
    `matryoshka_dimensions` or `is_matryoshka`), which a request's `dimensions` needs."""

    mode: str = "last"
    normalize: bool = True
    matryoshka: bool = False
    head: object = field(default=None, compare=False)  # a ScoreHead: what `score` reads

    @classmethod
    def from_folder(cls, folder: str | Path | None) -> "Pooling":
        if folder is None or not Path(folder).is_dir():
            return cls()
        folder = Path(folder)
        config = _read(folder / "config.json") or {}
        matryoshka = bool(config.get("matryoshka_dimensions") or config.get("is_matryoshka"))
        modules = _read(folder / "modules.json")
        if not isinstance(modules, list):
            return cls(matryoshka=matryoshka)
        kinds = [str(m.get("type", "")) for m in modules]
        normalize = any(k.endswith(".Normalize") for k in kinds)
        mode = "last"
        for m, kind in zip(modules, kinds):
            if kind.endswith(".Pooling"):
                setting = _read(folder / m.get("path", "") / "config.json") or {}
                modes = [name for key, name in _MODES.items() if setting.get(key)]
                others = [k for k, v in setting.items()
                          if k.startswith("pooling_mode_") and v and k not in _MODES]
                if others or len(modes) != 1:
                    raise ValueError(f"{folder}: the pooling {others or modes} is not "
                                     "supported: tidal pools by one of the mean, the first "
                                     "(CLS) or the last token")
                mode = modes[0]
        return cls(mode, normalize, matryoshka)

    def add(self, state: tuple[torch.Tensor, int] | None, hidden: torch.Tensor, first: int,
            prompt_len: int) -> tuple[torch.Tensor, int] | None:
        """Fold a chunk's rows (prompt positions `first`.. of `prompt_len`) into `state`:
        (the sum or the row kept, rows counted)."""
        rows = hidden.shape[0]
        if self.mode == "mean":
            total = hidden.float().sum(0)
            return (total, rows) if state is None else (state[0] + total, state[1] + rows)
        if self.mode == "cls" and first == 0:
            return hidden[0].float(), 1
        if self.mode == "last" and first + rows == prompt_len:
            return hidden[-1].float(), 1
        return state

    def score(self, state: tuple[torch.Tensor, int]) -> list[float]:
        """The score head's reading of the pooled state (tidal.model.score_head): a
        relevance score as a one-value vector, or a classifier's probabilities."""
        return self.head.reading(state[0] / state[1])

    def finish(self, state: tuple[torch.Tensor, int], dimensions: int = 0) -> list[float]:
        """The embedding: its first `dimensions` (0: all), then scaled to unit length."""
        vector = state[0] / state[1]
        if dimensions:
            vector = vector[:dimensions]
        if self.normalize:
            vector = vector / vector.norm().clamp_min(1e-12)
        return vector.tolist()


def _read(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None
