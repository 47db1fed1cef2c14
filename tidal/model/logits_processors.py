"""Custom logits processors (vLLM's `--logits-processors`): classes the server or `LLM`
loads by name at start, each made once per engine core, that see every step's logits
before sampling. A request reaches them through its `extra_args` (the API's
`vllm_xargs`), which each class checks when the request arrives.

A processor subclasses `LogitsProcessor` (or has its three methods):

    class OnlyToken(LogitsProcessor):
        @classmethod
        def validate_params(cls, extra_args):
            if not isinstance(extra_args.get("target_token", 0), int):
                raise ValueError("target_token must be a token id")

        def apply(self, logits, rows):
            for i, row in enumerate(rows):
                token = row.extra_args.get("target_token")
                if token is not None:
                    kept = logits[i, token].clone()
                    logits[i] = float("-inf")
                    logits[i, token] = kept

It runs after logit_bias, bans and allowed_token_ids and before temperature and the
top-k/top-p/min-p filters; logprobs are those of the distribution it leaves."""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Sequence

if TYPE_CHECKING:
    import torch


@dataclass
class LogitsRow:
    """What a processor knows of one logits row: its request's extra_args ({} if none), its
    prompt, and its output so far (with a speculative row's guesses before it)."""

    extra_args: dict[str, Any]
    prompt_ids: list[int]
    output_ids: list[int] = field(default_factory=list)


class LogitsProcessor:
    """A custom logits processor's base: made once per engine core with the model's
    vocabulary size and the logits' device."""

    def __init__(self, vocab_size: int, device: "torch.device") -> None:
        self.vocab_size, self.device = vocab_size, device

    @classmethod
    def validate_params(cls, extra_args: dict[str, Any]) -> None:
        """Raise ValueError for extra_args this processor cannot take (a 400 on the
        server, naming vllm_xargs; a ValueError from `LLM.generate`)."""

    def apply(self, logits: "torch.Tensor", rows: list[LogitsRow]) -> None:
        """Change `logits` ([rows, vocab], float32) in place; row i is `rows[i]`'s."""
        raise NotImplementedError


def load_processors(names: Sequence[str]) -> list[type]:
    """The classes `names` give, each 'package.module:Class' or 'package.module.Class';
    ValueError naming one that does not import or lacks `apply`."""
    classes = []
    for name in names:
        module, _, attr = name.partition(":") if ":" in name else name.rpartition(".")
        try:
            cls = getattr(importlib.import_module(module), attr) if module and attr else None
        except (ImportError, AttributeError) as exc:
            raise ValueError(f"logits processor {name!r} does not import: {exc}") from None
        if cls is None or not callable(getattr(cls, "apply", None)):
            raise ValueError(f"logits processor {name!r} is not a class with apply(logits, "
                             "rows) ('package.module:Class')")
        classes.append(cls)
    return classes


def check_extra_args(classes: Sequence[type], extra_args: dict[str, Any] | None) -> None:
    """ValueError if extra_args are given with no processor to read them, or one of the
    processors refuses them."""
    if extra_args is None:
        return
    if not classes:
        raise ValueError("extra_args need custom logits processors (logits_processors, "
                         "--logits-processors): none is loaded")
    for cls in classes:
        check = getattr(cls, "validate_params", None)
        if check is not None:
            check(extra_args)
