"""Command-line flags for the engine's options: one flag per config field, typed from its
default and documented by its help text (see tidal/engine/config.py).

`tidal generate` and `tidal serve` (tidal/cli.py), `tidal simulate` and `tidal calibrate`
(tidal/sim/cli.py) and `tidal bench serve` (tidal/bench/serve.py) share these helpers; they
live here, beside the configs, so that bench/ and sim/ never import the top-level CLI.
"""

from __future__ import annotations

import argparse
from contextlib import contextmanager
from typing import Any, Iterator

from tidal.engine.config import all_fields, option_type

# Where a parser records which engine options it has flags for (see engine_kwargs).
_OPTIONS = "_engine_options"


def _parse_bool(text: str) -> bool:
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def add_engine_flags(parser: argparse.ArgumentParser, only: tuple[str, ...] | None = None,
                     extra: tuple[str, ...] = ()) -> None:
    """One flag per engine option, typed from its default. `only`: the options of these
    parts of the config tree (e.g. ("cache", "scheduler")); `extra`: these options too,
    from any part. A flag not given leaves its option unset (the config's default)."""
    group = parser.add_argument_group("engine options")
    wanted = {name for name, _, _ in all_fields(only)} | set(extra)
    chosen = [opt for opt in all_fields() if opt[0] in wanted]
    if len(chosen) != len(wanted):
        raise KeyError(f"not engine options: {sorted(wanted - {o[0] for o in chosen})}")
    for name, default, help_text in chosen:
        flag = "--" + name.replace("_", "-")
        if isinstance(default, bool):
            kind = _parse_bool
        elif isinstance(default, (int, float)):
            kind = type(default)
        else:  # None: the annotation says (int for `int | None`)
            kind = option_type(name)
        group.add_argument(flag, dest=name, type=kind, default=argparse.SUPPRESS,
                           help=f"{help_text} (default: {default})")
    added = tuple(parser.get_default(_OPTIONS) or ()) + tuple(name for name, _, _ in chosen)
    parser.set_defaults(**{_OPTIONS: added})


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
