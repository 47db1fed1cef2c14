"""Config fields with their help text, and the checks their values share. Its own module so
that the policies, which declare their options with it, need not import tidal/core/config.py
(which imports them)."""

from __future__ import annotations

from dataclasses import field
from typing import Any


def knob(default: Any, help: str) -> Any:
    """A config field with a default and its help text (`metadata["help"]`)."""
    return field(default=default, metadata={"help": help})


def check_choice(name: str, value: str, allowed: tuple[str, ...]) -> None:
    """ValueError unless `value` is one of `allowed`."""
    if value not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(allowed)}; got {value!r}")


def check_at_least_one(config: Any, *names: str) -> None:
    """ValueError unless each named field of `config` is at least 1."""
    for name in names:
        if getattr(config, name) < 1:
            raise ValueError(f"{name} must be at least 1, got {getattr(config, name)}")


def check_positive(config: Any, *names: str) -> None:
    """ValueError unless each named field of `config` is unset (None) or > 0."""
    for name in names:
        value = getattr(config, name)
        if value is not None and value <= 0:
            raise ValueError(f"{name} must be > 0, got {value}")
