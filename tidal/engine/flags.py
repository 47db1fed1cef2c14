"""Command-line flags for config dataclasses: one flag per field, typed from its default and
documented by its help text. The engine's options (tidal/engine/config.py) and any other config
of `knob` fields (the server's, tidal/server/config.py) get theirs the same way.

`tidal generate` and `tidal serve` (tidal/cli.py), `tidal simulate` and `tidal calibrate`
(tidal/sim/cli.py) and `tidal bench serve` (tidal/bench/serve.py) share these helpers; they
live here, beside the configs, so that bench/ and sim/ never import the top-level CLI.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from contextlib import contextmanager
from typing import Any, Iterator

from tidal.core.config import help_table
from tidal.engine.config import all_fields, option_type

# Where a parser records which engine options it has flags for (see engine_kwargs).
_OPTIONS = "_engine_options"


def _parse_bool(text: str) -> bool:
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def _add_flags(group, rows: list[tuple[str, Any, str]], type_of) -> None:
    """One flag per (name, default, help) row, typed from its default (`type_of(name)` when
    the default is None). A flag not given leaves its option unset (the config's default)."""
    for name, default, help_text in rows:
        flag = "--" + name.replace("_", "-")
        if isinstance(default, tuple):  # a list: each value a word (name=path, ...)
            group.add_argument(flag, dest=name, nargs="+", default=argparse.SUPPRESS,
                               help=f"{help_text} (default: {' '.join(default) or 'none'})")
            continue
        if isinstance(default, bool):  # `--flag` alone means true, as vLLM's switches
            group.add_argument(flag, dest=name, type=_parse_bool, nargs="?", const=True,
                               default=argparse.SUPPRESS,
                               help=f"{help_text} (default: {default})")
            # and `--no-flag` false, as vLLM's (argparse.BooleanOptionalAction)
            group.add_argument(f"--no-{flag[2:]}", dest=name, action="store_false",
                               default=argparse.SUPPRESS, help=argparse.SUPPRESS)
            continue
        if isinstance(default, (int, float)):
            kind = type(default)
        else:  # None: the annotation says (int for `int | None`)
            kind = type_of(name)
        group.add_argument(flag, dest=name, type=kind, default=argparse.SUPPRESS,
                           help=f"{help_text} (default: {default})")


def add_engine_flags(parser: argparse.ArgumentParser, only: tuple[str, ...] | None = None,
                     extra: tuple[str, ...] = ()) -> None:
    """One flag per engine option. `only`: the options of these parts of the config tree
    (e.g. ("cache", "scheduler")); `extra`: these options too, from any part."""
    wanted = {name for name, _, _ in all_fields(only)} | set(extra)
    chosen = [opt for opt in all_fields() if opt[0] in wanted]
    if len(chosen) != len(wanted):
        raise KeyError(f"not engine options: {sorted(wanted - {o[0] for o in chosen})}")
    _add_flags(parser.add_argument_group("engine options"), chosen, option_type)
    added = tuple(parser.get_default(_OPTIONS) or ()) + tuple(name for name, _, _ in chosen)
    parser.set_defaults(**{_OPTIONS: added})


def add_config_flags(parser: argparse.ArgumentParser, cls: type, title: str) -> None:
    """One flag per field of the config dataclass `cls`, as the engine's options get theirs;
    `config_from_args(cls, args)` builds it back."""
    hints = typing.get_type_hints(cls)

    def type_of(name: str) -> type:
        kinds = [t for t in typing.get_args(hints[name]) if t is not type(None)]
        return kinds[0] if kinds else hints[name]
    _add_flags(parser.add_argument_group(title), help_table(cls), type_of)


def config_from_args(cls: type, args: argparse.Namespace, **overrides: Any) -> Any:
    """`cls` from the flags `add_config_flags` made (defaults for those not given), with
    `overrides` on top."""
    names = {f.name for f in dataclasses.fields(cls)}
    given = {k: tuple(v) if isinstance(v, list) else v  # a list's words, as its default
             for k, v in vars(args).items() if k in names}
    return cls(**{**given, **overrides})


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The engine options given on the command line, by name: what `LLM(**kwargs)` and
    `EngineConfig.from_kwargs(**kwargs)` take. Only the parser's engine flags count, so a
    command's own flag of the same name (`tidal simulate --seed`, the workload's) is not
    taken for an engine option."""
    names = getattr(args, _OPTIONS, None)
    if names is None:  # a namespace not made by a parser with engine flags
        names = [name for name, _, _ in all_fields()]
    return {k: v for k, v in vars(args).items() if k in names}


@contextmanager
def flag_errors(command: str) -> Iterator[None]:
    """Around what turns flags into configs and workloads: a value that fails validation or
    a file that is not there ends the command with its message, not a traceback."""
    try:
        yield
    except (ValueError, FileNotFoundError) as e:
        raise SystemExit(f"tidal {command}: error: {e}") from None
