"""The tokenizer of a model folder: `tokenizers` for text <-> ids (loads in ~0.1 s where
transformers' AutoTokenizer takes over a second) and jinja2 for the chat template."""

from __future__ import annotations

import json
from pathlib import Path

from jinja2 import TemplateError

from tidal.model.chat_template import ChatTemplate, compiled, template_source


def _token_text(value) -> str | None:
    return value.get("content") if isinstance(value, dict) else value


def tokenizer_folder(tokenizer: str | None, model_folder: str | Path) -> Path:
    """The folder whose tokenizer serves: `tokenizer` (the engine's `--tokenizer`), else
    the model's."""
    if tokenizer is None:
        return Path(model_folder)
    if not (Path(tokenizer) / "tokenizer.json").is_file():  # e.g. a hub's name
        raise FileNotFoundError(f"tokenizer {tokenizer!r} is not a folder with a "
                                "tokenizer.json (tidal downloads nothing)")
    return Path(tokenizer)


class Tokenizer:
    """encode / decode / apply_chat_template over `tokenizer.json`, `tokenizer_config.json`
    and the chat template (`chat_template.jinja` or the config's `chat_template`)."""

    def __init__(self, folder: str | Path, chat_template: str | None = None,
                 template_kwargs: dict | None = None, content_format: str = "auto") -> None:
        """`chat_template` (a file's path or the template; template_source) replaces the
        model's own; `template_kwargs` are variables every render takes unless it sets its
        own; `content_format` how messages' content reaches it (ChatTemplate.render's)."""
        from tokenizers import Tokenizer as HFTokenizer

        folder = Path(folder)
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"{folder} has no tokenizer.json")
        self._tk = HFTokenizer.from_file(str(path))
        cfg_path = folder / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        self.bos_token = _token_text(cfg.get("bos_token"))
        self.eos_token = _token_text(cfg.get("eos_token"))
        self.eos_token_id = self._tk.token_to_id(self.eos_token) if self.eos_token else None
        self.vocab_size = self._tk.get_vocab_size()
        self.template_kwargs = dict(template_kwargs or {})
        self.content_format = content_format
        template = cfg.get("chat_template")
        if (folder / "chat_template.jinja").is_file():
            template = (folder / "chat_template.jinja").read_text()
        if chat_template is not None:
            template = template_source(chat_template)
        special = {name: _token_text(cfg[name]) or "" for name in
                   ("bos_token", "eos_token", "unk_token", "pad_token") if cfg.get(name)}
        self._special = tuple(sorted(special.items()))
        try:
            self.chat_template = (compiled(template, self._special) if template is not None
                                  else None)
        except TemplateError as exc:
            if chat_template is None:
                raise
            raise ValueError(f"the chat template does not compile: {exc}") from None

    def to_json(self) -> str:
        """The tokenizer as tokenizer.json text (what llguidance reads)."""
        return self._tk.to_str()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tk.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_pair(self, first: str, second: str) -> list[int]:
        """Two texts as one sequence, the way the tokenizer joins a pair (its
        post-processor's special tokens between and around them)."""
        return self._tk.encode(first, second, add_special_tokens=True).ids

    def bad_word_ids(self, words: list[str]) -> list[list[int]]:
        """Each word's token sequences, as vLLM's bad_words ban them: the word as written
        and with one leading space (how it reads after another word), each once."""
        out: list[list[int]] = []
        for word in words:
            for text in (word.lstrip(), " " + word.lstrip()):
                ids = self.encode(text, add_special_tokens=False)
                if ids and ids not in out:
                    out.append(ids)
        return out

    def token_strings(self, ids: list[int]) -> list[str]:
        """Each id's token as the vocabulary spells it (byte-level pieces such as "Ġthe")."""
        return [self._tk.id_to_token(i) or "" for i in ids]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tk.decode(ids, skip_special_tokens=skip_special_tokens)

    def template(self, chat_template: str | None = None) -> ChatTemplate | None:
        """The model's chat template, or the one whose text is `chat_template` (compiled
        once; jinja2.TemplateError if it does not compile)."""
        if chat_template is None:
            return self.chat_template
        return compiled(chat_template, self._special)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            chat_template: str | None = None, **kwargs) -> str:
        """The conversation as prompt text (ChatTemplate.render's arguments), through the
        model's template or `chat_template` (its text)."""
        template = self.template(chat_template)
        if template is None:
            raise ValueError("this model has no chat template: send a plain prompt instead, "
                             "or start the server with --chat-template")
        return template.render(messages, add_generation_prompt,
                               **{**self.template_kwargs, "content_format": self.content_format,
                                  **kwargs})
