"""tidal's structure: imports go down the layers, no file is over 500 lines, configs are
frozen, and every engine option has one name.

Layers, lowest first: core < model < engine < cluster < runtime < server < cli (tidal/cli.py,
and any other top-level module such as `python -m tidal.config_docs`). A module imports its own
layer and the ones below it; core imports only core. spec/ (speculative decoding's guessers)
is of the engine's layer. bench/ and sim/ stand beside the stack:
they may import core, model, engine (the flag helpers are tidal/engine/flags.py), cluster
and each other, never server or cli; of the stack, only cli imports them. Every import
counts, at module level or inside a function.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import graphlib
from pathlib import Path

import pytest

import tidal

ROOT = Path(tidal.__file__).resolve().parent
RANKS = {"core": 0, "model": 1, "engine": 2, "cluster": 3, "runtime": 4, "server": 5, "cli": 6}
BESIDE = "beside"
BESIDE_MAY_IMPORT = {"core", "model", "engine", "cluster", BESIDE}
PACKAGES = {"core": "core", "model": "model", "engine": "engine", "cluster": "cluster",
            "runtime": "runtime", "server": "server", "spec": "engine", "bench": BESIDE,
            "sim": BESIDE}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def layer(module: str) -> str:
    """The layer of a module of tidal, by its dotted name."""
    parts = module.split(".")
    if parts == ["tidal"]:
        return "engine"  # tidal/__init__.py: the offline API's facade (LLM, SamplingParams)
    if parts[1] in PACKAGES:
        return PACKAGES[parts[1]]
    if (ROOT / f"{parts[1]}.py").is_file():
        return "cli"  # a top-level module: the command line and other entry points
    raise AssertionError(f"{module}: which layer? add its package to PACKAGES in {__file__}")


def is_module(name: str) -> bool:
    path = ROOT.parent.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or path.is_dir()


def imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every import of a tidal module in the file, nested ones too."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package, up level - 1 packages
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
            for alias in node.names:  # `from tidal import cli` imports the module tidal.cli
                sub = f"{base}.{alias.name}"
                found.append((node.lineno, sub if is_module(sub) else base))
    return [(line, m) for line, m in found if m == "tidal" or m.startswith("tidal.")]


def allowed(src: str, dst: str) -> bool:
    if src == dst:
        return True
    if src == BESIDE:
        return dst in BESIDE_MAY_IMPORT
    if dst == BESIDE:
        return src == "cli"  # the command line builds `tidal bench` and `tidal simulate`
    return RANKS[dst] <= RANKS[src]


SOURCES = sorted(ROOT.rglob("*.py"))


def test_every_module_has_a_layer():
    assert SOURCES and all(layer(module_name(p)) for p in SOURCES)


def test_no_import_goes_up_a_layer():
    wrong = []
    for path in SOURCES:
        src = layer(module_name(path))
        for line, target in imports(path):
            dst = layer(target)
            if not allowed(src, dst):
                wrong.append(f"{path.relative_to(ROOT.parent)}:{line} ({src}) imports "
                             f"{target} ({dst})")
    assert wrong == [], "\n".join(wrong)


def test_the_rules_catch_what_they_should():
    """The checker itself: relative imports resolve, and each kind of wrong import fails."""
    assert not allowed("core", "model") and not allowed("engine", "cluster")
    assert not allowed("cluster", "runtime") and not allowed("runtime", "server")
    assert not allowed(BESIDE, "server") and not allowed(BESIDE, "cli")
    assert not allowed("server", BESIDE) and allowed("cli", BESIDE)
    assert allowed(BESIDE, "engine") and allowed("server", "cluster")
    assert layer("tidal.engine.flags") == "engine" and layer("tidal.cli") == "cli"
    tree = ROOT / "sim" / "cli.py"
    assert any(m == "tidal.engine.flags" for _, m in imports(tree))


def _type_checking_lines(path: Path) -> set[int]:
    """Lines of imports under `if TYPE_CHECKING:` (annotations only: never run)."""
    lines = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            lines |= {n.lineno for sub in node.body for n in ast.walk(sub)
                      if isinstance(n, (ast.Import, ast.ImportFrom))}
    return lines


def test_no_module_imports_itself_through_others():
    """No import cycle among tidal's modules (each one's imports at run time, nested ones
    too): a cycle works only by the order modules happen to load in."""
    graph = {}
    for path in SOURCES:
        skip = _type_checking_lines(path)
        name = module_name(path)
        graph[name] = {m for line, m in imports(path) if line not in skip and m != name}
    try:
        list(graphlib.TopologicalSorter(graph).static_order())
    except graphlib.CycleError as exc:
        raise AssertionError(f"import cycle: {' -> '.join(exc.args[1])}") from None


def test_bench_and_sim_do_not_import_the_command_line():
    offenders = [f"{p.relative_to(ROOT.parent)}:{line}" for p in SOURCES
                 if layer(module_name(p)) == BESIDE
                 for line, m in imports(p) if m == "tidal.cli"]
    assert offenders == []


MAX_LINES = 500  # a file past this holds more than one job: split it


def test_no_file_is_over_the_line_cap():
    """Every Python file of the package, its tests and its benchmarks stays within
    MAX_LINES lines."""
    repo = ROOT.parent
    files = [*ROOT.rglob("*.py"), *(repo / "tests").rglob("*.py"),
             *(repo / "benchmarks").rglob("*.py")]
    over = {str(p.relative_to(repo)): n for p in files
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert len(files) > 100 and over == {}


# Configs: frozen, with one name per engine option.

def config_classes():
    from tidal.core.config import CacheConfig, SchedulerConfig
    from tidal.engine.config import EngineConfig, ModelConfig, ParallelConfig
    from tidal.model.config import ModelArch
    from tidal.server.config import HttpConfig, ServerConfig

    return [CacheConfig, SchedulerConfig, ModelConfig, ParallelConfig, EngineConfig, ModelArch,
            HttpConfig, ServerConfig]


@pytest.mark.parametrize("cls", config_classes(), ids=lambda c: c.__name__)
def test_configs_are_frozen(cls):
    assert cls.__dataclass_params__.frozen
    if cls.__name__ != "ModelArch":  # every other config has a default for each field
        config = cls()
        name = dataclasses.fields(cls)[0].name
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(config, name, getattr(config, name))


def test_the_kv_pool_is_set_by_num_kv_blocks_only():
    from tidal.engine.config import EngineConfig, all_fields

    config = EngineConfig.from_kwargs(num_kv_blocks=48, block_size=8)
    assert config.cache.num_blocks == config.model.num_kv_blocks == 48
    with pytest.raises(TypeError, match="num_kv_blocks"):
        EngineConfig.from_kwargs(num_blocks=48)
    names = [name for name, _, _ in all_fields()]
    assert "num_blocks" not in names and len(names) == len(set(names))


def test_engine_flags_are_the_parsers_own():
    """engine_kwargs returns the engine flags given, and not a command's own flag that
    shares a name with an engine option (`tidal simulate --seed` seeds the workload)."""
    from tidal.engine.flags import add_engine_flags, engine_kwargs

    parser = argparse.ArgumentParser()
    parser.add_argument("--seed", type=int, default=0)
    add_engine_flags(parser, only=("cache",), extra=("num_kv_blocks",))
    args = parser.parse_args(["--seed", "3", "--num-kv-blocks", "12",
                              "--enable-prefix-caching", "false"])
    assert engine_kwargs(args) == {"num_kv_blocks": 12, "enable_prefix_caching": False}
    assert engine_kwargs(parser.parse_args([])) == {}
    with pytest.raises(KeyError):
        add_engine_flags(argparse.ArgumentParser(), extra=("num_blocks",))


def _other_value(name: str, default):
    """A valid value of option `name` other than its default."""
    from tidal.engine.config import option_type

    if isinstance(default, str):
        return {"slo_overload": "reject"}[name]  # a new str option: add a value here
    if name == "slo_step_headroom":  # a share: at most 1
        return default / 2
    return option_type(name)(7 if default is None else default * 2)


def test_every_policy_option_is_a_flag_and_an_engine_keyword():
    """Each field of each policy's Options is an engine option of the same name: a flag
    carrying its help text (led by its policy's name), a keyword that `EngineConfig.
    from_kwargs` (what `LLM(**kwargs)` calls) hands to that policy's options, and a row of
    docs/configuration.md. With another policy, the value is refused naming its policy."""
    from tidal.config_docs import render
    from tidal.core.policies import POLICIES
    from tidal.engine.config import EngineConfig, all_fields
    from tidal.engine.flags import add_engine_flags, engine_kwargs

    parser = argparse.ArgumentParser()
    add_engine_flags(parser)
    helps = {a.dest: a.help for a in parser._actions}
    rows = {name: (default, text) for name, default, text in all_fields(only=("scheduler",))}
    doc = render()
    seen = 0
    for policy, cls in POLICIES.items():
        for f in dataclasses.fields(cls.Options):
            seen += 1
            flag, text = "--" + f.name.replace("_", "-"), f.metadata["help"]
            assert text and rows[f.name] == (f.default, f"({policy} policy) {text}")
            assert helps[f.name] == f"({policy} policy) {text} (default: {f.default})"
            assert f"| `{f.name}` | `{flag}` |" in doc
            value = _other_value(f.name, f.default)
            args = parser.parse_args(["--policy", policy, flag, str(value)])
            config = EngineConfig.from_kwargs(**engine_kwargs(args))
            assert type(config.scheduler.policy_options) is cls.Options
            assert getattr(config.scheduler.policy_options, f.name) == value
            keyword = EngineConfig.from_kwargs(policy=policy, **{f.name: value})
            assert keyword == config
            with pytest.raises(ValueError, match=f"{f.name} is an option of the {policy} "
                                                 "policy; this scheduler runs 'fcfs'"):
                EngineConfig.from_kwargs(**{f.name: value})
    assert seen >= 6  # longest_prefix_match's two and slo's four at least


def _subparser(name: str) -> argparse.ArgumentParser:
    from tidal.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


def test_server_options_are_one_mechanism_with_the_engines():
    """Every ServerConfig field is a `tidal serve` flag carrying its help text and default,
    read back by the same helper; no server option shares a name with an engine option; the
    router takes exactly the HttpConfig part; a bad value is the config's own error."""
    from tidal.engine.config import all_fields
    from tidal.engine.flags import config_from_args
    from tidal.server.config import HttpConfig, ServerConfig

    serve, router = _subparser("serve"), _subparser("router")
    helps = {a.dest: a.help for a in serve._actions  # tidal's own flag (not --no-, vLLM's)
             if f"--{a.dest.replace('_', '-')}" in a.option_strings}
    server_fields = dataclasses.fields(ServerConfig)
    for f in server_fields:  # a list's default as its flag takes it, words
        shown = (" ".join(f.default) or "none") if isinstance(f.default, tuple) else f.default
        assert helps[f.name] == f"{f.metadata['help']} (default: {shown})", f.name
    assert not {f.name for f in server_fields} & {name for name, _, _ in all_fields()}
    args = serve.parse_args(["--port", "9001", "--max-n", "4", "--max-total-tokens", "64",
                             "--reasoning-parser", "think", "--dtype", "float32"])
    config = config_from_args(ServerConfig, args)
    assert config == ServerConfig(port=9001, max_n=4, max_total_tokens=64,
                                  reasoning_parser="think")
    assert config_from_args(HttpConfig, args) == HttpConfig(port=9001)
    router_flags = {a.dest for a in router._actions} - {"help", "prefill", "decode", "func"}
    assert router_flags == {f.name for f in dataclasses.fields(HttpConfig)}
    for bad, match in ((["--tool-call-parser", "xml"], "tool_call_parser must be one of"),
                       (["--pd", "2P0D"], "pd expects xPyD"),
                       (["--restart-core", "-1"], "restart-core"),
                       (["--max-n", "0"], "max_n must be at least 1"),
                       (["--served-model-name", "a", "a"], "distinct, non-blank")):
        with pytest.raises(ValueError, match=match):
            config_from_args(ServerConfig, serve.parse_args(bad))
