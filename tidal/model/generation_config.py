"""What a model's makers recommend for generating with it: the tokens that end a generation,
and sampling defaults (`generation_config.json`, as vLLM's `--generation-config` reads it).

A chat model often ends its turn with a token other than its tokenizer's EOS (Gemma's
`<end_of_turn>`, Llama 3's `<|eot_id|>` and `<|eom_id|>`, Phi-3's `<|end|>`): config.json
and generation_config.json list them as `eos_token_id`. A GGUF file carries its EOS, EOT and
EOM ids, and llama.cpp also ends at tokens named as turn ends (END_TOKEN_NAMES);
gguf_convert writes them all into the converted folder's generation_config.json, so one
reader serves both.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

log = logging.getLogger("tidal.model")

# Token texts llama.cpp ends a generation at in a GGUF file (llama-vocab.cpp's EOG list, the
# entries of the families tidal runs).
END_TOKEN_NAMES = frozenset({
    "<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>",
    "<|end_of_text|>", "<EOT>", "<｜end▁of▁sentence｜>"})

# generation_config.json's sampling fields -> the request fields they set by default, with
# the range a request may give (max_new_tokens: the output limit when a request sets none).
SAMPLING_FIELDS: dict[str, tuple[str, float, float]] = {
    "temperature": ("temperature", 0.0, 2.0),
    "top_p": ("top_p", 0.0, 1.0),
    "top_k": ("top_k", -1, 2**63 - 1),
    "min_p": ("min_p", 0.0, 1.0),
    "repetition_penalty": ("repetition_penalty", 0.0, 10.0),
    "max_new_tokens": ("max_tokens", 1, 2**63 - 1),
}
GENERATION_CONFIG = "generation_config.json"
# --generation-config values that read no file: the engine's own defaults ('vllm': vLLM's
# spelling of the same).
ENGINE_DEFAULTS = ("tidal", "vllm")


def _read(path: Path) -> dict:
    try:
        cfg = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path} does not read as JSON: {exc}") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{path} must hold a JSON object")
    return cfg


def _ids(value: Any) -> list[int]:
    """An `eos_token_id` (an int, a list of them, or null) as a list."""
    values = value if isinstance(value, list) else [] if value is None else [value]
    return [v for v in values if isinstance(v, int) and not isinstance(v, bool) and v >= 0]


def end_token_ids(folder: str | Path, first: int | None = None) -> tuple[int, ...]:
    """The tokens that end a generation of the model in `folder`: `first` (the tokenizer's
    EOS), then config.json's and generation_config.json's `eos_token_id`, each once."""
    folder = Path(folder)
    ids = [] if first is None else [first]
    for name in ("config.json", GENERATION_CONFIG):
        if (folder / name).is_file():
            ids += _ids(_read(folder / name).get("eos_token_id"))
    return tuple(dict.fromkeys(ids))


def _checked(key: str, value: Any) -> float | int:
    """A sampling field's value as a request would give it; a ValueError says its range."""
    _, low, high = SAMPLING_FIELDS[key]
    integer = isinstance(low, int)
    positive = key in ("top_p", "repetition_penalty")  # 0 is no distribution, no penalty
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (
            integer and not float(value).is_integer()) or not math.isfinite(value) or (
            not low <= value <= high) or (positive and value == 0):
        kind = "an integer" if integer else "a number"
        bound = f"({low}, {high}]" if positive else f"[{low}, {high}]"
        raise ValueError(f"{key} must be {kind} in {bound}, got {value!r}")
    return int(value) if integer else float(value)


def parse_overrides(text: str | None) -> dict[str, float | int]:
    """--override-generation-config's JSON object as the request fields it sets, each
    checked (a ValueError names the first field tidal does not know or the value out of
    its range)."""
    if text is None:
        return {}
    try:
        overrides = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"override_generation_config is not JSON: {exc}") from None
    if not isinstance(overrides, dict):
        raise ValueError("override_generation_config must be a JSON object, e.g. "
                         "'{\"temperature\": 0.5}'")
    fields = {}
    for key, value in overrides.items():
        if key not in SAMPLING_FIELDS:
            raise ValueError(f"override_generation_config: unknown field {key!r}; known: "
                             f"{', '.join(SAMPLING_FIELDS)}")
        try:
            fields[SAMPLING_FIELDS[key][0]] = _checked(key, value)
        except ValueError as exc:
            raise ValueError(f"override_generation_config: {exc}") from None
    return fields


def sampling_defaults(folder: str | Path, source: str = "auto",
                      overrides: str | None = None) -> dict[str, float | int]:
    """The request fields a generation request leaves unset take these values: the
    generation_config.json of `folder` (source 'auto'), of another folder (source: its
    path) or none ('tidal', 'vllm'), with `overrides` (a JSON object) over it. A file's
    value out of a request's range is left out, with a warning; an override's is a
    ValueError naming it."""
    cfg: dict[str, Any] = {}
    if source not in ENGINE_DEFAULTS:
        where = Path(folder) if source == "auto" else Path(source).expanduser()
        if source != "auto" and not (where / GENERATION_CONFIG).is_file():
            raise ValueError(f"--generation-config {source!r}: no {GENERATION_CONFIG} there "
                             "(give a folder holding one, 'auto' or 'vllm')")
        if (where / GENERATION_CONFIG).is_file():
            cfg = _read(where / GENERATION_CONFIG)
    defaults: dict[str, float | int] = {}
    for key, value in cfg.items():
        if key in SAMPLING_FIELDS and value is not None:
            try:
                defaults[SAMPLING_FIELDS[key][0]] = _checked(key, value)
            except ValueError as exc:
                log.warning("%s: %s; left out", where / GENERATION_CONFIG, exc)
    return {**defaults, **parse_overrides(overrides)}
