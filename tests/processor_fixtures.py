"""A custom logits processor for the tests (`--logits-processors
tests.processor_fixtures:OnlyToken`, importable from the repository's root): a request
whose vllm_xargs hold `target_token` gets that token alone; `after` (a count) lets the
first outputs be, so the output it reads is checked too."""

from __future__ import annotations

from tidal.model.logits_processors import LogitsProcessor


class OnlyToken(LogitsProcessor):
    @classmethod
    def validate_params(cls, extra_args):
        token = extra_args.get("target_token", 0)
        if not isinstance(token, int) or isinstance(token, bool) or token < 0:
            raise ValueError(f"target_token must be a token id, got {token!r}")

    def apply(self, logits, rows):
        for i, row in enumerate(rows):
            token = row.extra_args.get("target_token")
            if token is None or len(row.output_ids) < row.extra_args.get("after", 0):
                continue
            kept = logits[i, token].clone()
            logits[i] = float("-inf")
            logits[i, token] = kept
