"""A word-level tokenizer for models with random weights (`--load-format dummy`, benchmarks):
token i is the word `w<i>`, so a prompt of such words re-encodes to the same ids in any
server that reads tokenizer.json."""

from __future__ import annotations

import json
from pathlib import Path


def save_word_tokenizer(folder: Path, vocab_size: int, eos_token_id: int | None = None) -> None:
    """tokenizer.json (and, with an EOS, a tokenizer_config.json transformers reads) in
    `folder`."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(vocab_size)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(folder / "tokenizer.json"))
    if eos_token_id is not None:
        (folder / "tokenizer_config.json").write_text(json.dumps(
            {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": f"w{eos_token_id}",
             "bos_token": "w1"}))
