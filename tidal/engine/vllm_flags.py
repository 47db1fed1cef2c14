"""vLLM's `serve` words that tidal spells otherwise, so that a vLLM command line (or its
`--config` YAML file) starts tidal as it is: flags of another name for the same option,
switches that ask for what tidal does anyway, `--speculative-config` as JSON, and
`--config FILE` whose keys are flags. A vLLM flag with no meaning here stays an error."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tidal.engine import sglang_flags

# vLLM's flag -> tidal's option of the same meaning
ALIASES = {"--max-num-batched-tokens": ("max_input_tokens_per_step", int),
           "--scheduling-policy": ("policy", str),
           "-tp": ("tensor_parallel_size", int), "-pp": ("pipeline_parallel_size", int),
           "-dp": ("data_parallel_size", int), "--num-gpu-blocks-override": ("num_kv_blocks", int),
           "--kv-cache-memory-bytes": ("kv_cache_memory", int),
           "--distributed-timeout-seconds": ("distributed_timeout", float),
           "--data-parallel-backend": ("dp_backend", str), "-dpb": ("dp_backend", str),
           "--long-prefill-token-threshold": ("chunked_prefill_size", int),
           "--kv-offloading-size": ("kv_host_memory", float),
           "--shutdown-timeout": ("drain_timeout", float)}
# vLLM's words for values of tidal's options: option -> {vLLM's value: tidal's}
VALUES = {"dtype": {"half": "float16", "float": "float32"}, "dp_backend": {"mp": "local"},
          "kv_cache_dtype": {"fp8": "fp8_e4m3"}}  # vLLM's fp8 is E4M3
# vLLM's switches that set one of tidal's options to a value
SWITCHES = {"--disable-log-stats": ("log_stats_interval", 0.0)}
# vLLM's switches that ask for what tidal does anyway, and why
ACCEPTED = {
    "--trust-remote-code": "tidal runs no code from a model's folder: its architectures "
                           "are its own",
    "--enable-auto-tool-choice": "tool_choice 'auto' is always served (--tool-call-parser)",
    "--enable-chunked-prefill": "prefills are always chunked (--chunked-prefill-size)",
    "--disable-log-requests": "requests are logged only with --enable-log-requests",
    "--enable-prompt-tokens-details": "usage always carries "
                                      "prompt_tokens_details.cached_tokens",
    "--enable-server-load-tracking": "GET /load always counts the requests being answered",
    "--enable-sleep-mode": "POST /sleep and /wake_up are always served",
    "--enable-request-id-headers": "every answer carries X-Request-Id"}
# vLLM's options with a value that have no meaning here, and why: accepted, ignored
IGNORED = {"--swap-space": (float, "a preempted request is recomputed, never swapped (vLLM "
                                   "V1 ignores it too); its full blocks stay in the prefix "
                                   "cache and its tiers (--kv-cache-dir)")}
# switches whose `false` in a --config file asks for nothing (they have no --no- form)
NOTHING_WHEN_OFF = {*ACCEPTED, *SWITCHES, *sglang_flags.ACCEPTED, *sglang_flags.SWITCHES}
# --speculative-config's keys -> tidal's options; its methods -> tidal's
SPECULATIVE_KEYS = {"method": "speculative_method",
                    "num_speculative_tokens": "num_speculative_tokens",
                    "model": "speculative_model", "prompt_lookup_min": "prompt_lookup_min",
                    "prompt_lookup_max": "prompt_lookup_max"}
SPECULATIVE_METHODS = {"ngram": "ngram", "suffix": "suffix", "draft_model": "draft",
                       "draft": "draft"}
# vLLM's and SGLang's names of the backend structured outputs run on here, llguidance
STRUCTURED_BACKENDS = ("auto", "guidance", *sglang_flags.GRAMMAR_BACKENDS)


def add_vllm_flags(parser: argparse.ArgumentParser) -> None:
    """vLLM's and SGLang's spellings on a command that has the engine's flags."""
    # tidal's own flag of each option: an alias takes as many values as it does
    own = {a.dest: a for a in parser._actions
           if f"--{a.dest.replace('_', '-')}" in a.option_strings}
    group = parser.add_argument_group("vLLM's flags (docs/configuration.md)")
    _add_words(group, own, "vLLM", ALIASES, SWITCHES, ACCEPTED)
    for flag, (kind, why) in IGNORED.items():
        group.add_argument(flag, type=kind, default=argparse.SUPPRESS,
                           help=f"accepted, no effect: {why}")
    sglang = parser.add_argument_group("SGLang's flags (docs/configuration.md)")
    _add_words(sglang, own, "SGLang", sglang_flags.ALIASES, sglang_flags.SWITCHES,
               sglang_flags.ACCEPTED)
    sglang.add_argument("--grammar-backend", dest="structured_outputs",
                        default=argparse.SUPPRESS, metavar="BACKEND",
                        help="SGLang's: the backend of structured outputs, which here is "
                             "llguidance")
    group.add_argument("--speculative-config", default=argparse.SUPPRESS, metavar="JSON",
                       help="vLLM's: {\"method\": \"ngram\"|\"suffix\"|\"draft_model\", "
                            "\"num_speculative_tokens\", \"model\", \"prompt_lookup_min\", "
                            "\"prompt_lookup_max\"}, as --speculative-method and its options")
    group.add_argument("--structured-outputs-config", "--guided-decoding-backend",
                       dest="structured_outputs", default=argparse.SUPPRESS,
                       metavar="JSON|BACKEND",
                       help="vLLM's: the backend of structured outputs, which here is "
                            "llguidance: 'auto' or 'guidance' ({\"backend\": ...})")
    group.add_argument("--config", default=argparse.SUPPRESS, metavar="YAML",
                       help="vLLM's: a YAML file of flags (keys without the dashes); flags "
                            "on the command line win over it")


def _add_words(group, own: dict, engine: str, aliases: dict, switches: dict,
               accepted: dict) -> None:
    """Another engine's flags of tidal's options (aliases: flag -> (option, type), each as
    many values as `own[option]`, tidal's flag, takes), switches that set one (flag ->
    (option, value)) and switches accepted without effect."""
    for flag, (dest, kind) in aliases.items():
        group.add_argument(flag, dest=dest, type=kind, nargs=own[dest].nargs,
                           default=argparse.SUPPRESS,
                           help=f"{engine}'s name for --{dest.replace('_', '-')}")
    for flag, (dest, value) in switches.items():
        group.add_argument(flag, dest=dest, action="store_const", const=value,
                           default=argparse.SUPPRESS,
                           help=f"{engine}'s: {switch_meaning(dest, value)}")
    for flag, why in accepted.items():
        group.add_argument(flag, action="store_true", default=argparse.SUPPRESS,
                           help=f"accepted, no effect: {why}")


def switch_meaning(dest: str, value) -> str:
    """What a switch of another engine sets, in tidal's flags."""
    flag = f"--{dest.replace('_', '-')}"
    if isinstance(value, bool):
        return flag if value else f"--no-{flag[2:]}"
    return f"{flag} {value:g}" if isinstance(value, float) else f"{flag} {value}"


def speculative_options(text: str) -> dict:
    """--speculative-config's JSON as tidal's options; ValueError naming what is wrong."""
    try:
        spec = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"speculative_config is not JSON: {exc}") from None
    if not isinstance(spec, dict):
        raise ValueError("speculative_config must be a JSON object")
    unknown = sorted(set(spec) - set(SPECULATIVE_KEYS))
    if unknown:
        raise ValueError(f"speculative_config: {', '.join(unknown)} not supported (tidal "
                         f"takes {', '.join(SPECULATIVE_KEYS)})")
    if "model" in spec and "method" not in spec:
        spec["method"] = "draft_model"  # vLLM's reading of a bare model
    if spec.get("method") not in SPECULATIVE_METHODS:
        raise ValueError(f"speculative_config.method must be one of "
                         f"{', '.join(SPECULATIVE_METHODS)}; got {spec.get('method')!r}")
    spec["method"] = SPECULATIVE_METHODS[spec["method"]]
    return {SPECULATIVE_KEYS[k]: v for k, v in spec.items()}


def check_structured_backend(text: str) -> None:
    """--structured-outputs-config (JSON), --guided-decoding-backend or SGLang's
    --grammar-backend (a name): ValueError unless it asks for the backend tidal runs
    (llguidance: vLLM's 'guidance', SGLang's 'llguidance') or 'auto'."""
    try:
        config = json.loads(text) if text.lstrip().startswith("{") else {"backend": text}
    except json.JSONDecodeError as exc:
        raise ValueError(f"structured_outputs_config is not JSON: {exc}") from None
    unknown = sorted(set(config) - {"backend"})
    if unknown:
        raise ValueError(f"structured_outputs_config: {', '.join(unknown)} not supported "
                         f"(tidal takes backend)")
    if config.get("backend", "auto") not in STRUCTURED_BACKENDS:
        raise ValueError(f"structured outputs run on llguidance here: the backend must be "
                         f"one of {', '.join(STRUCTURED_BACKENDS)}; got {config['backend']!r}")


def apply_vllm_flags(args: argparse.Namespace) -> None:
    """Turn the parsed vLLM words into tidal's options (in place); ValueError for a bad
    --speculative-config or a structured-outputs backend tidal does not run."""
    structured = vars(args).pop("structured_outputs", None)
    if structured is not None:
        check_structured_backend(structured)
    text = vars(args).pop("speculative_config", None)
    if text is not None:
        for name, value in speculative_options(text).items():
            if name in vars(args):
                raise ValueError(f"--{name.replace('_', '-')} and --speculative-config both "
                                 f"set {name}: give it once")
            setattr(args, name, value)
    for flag in [*ACCEPTED, *IGNORED, *sglang_flags.ACCEPTED]:
        vars(args).pop(flag[2:].replace("-", "_"), None)
    vars(args).pop("config", None)
    for name, words in [*VALUES.items(), *sglang_flags.VALUES.items()]:
        value = getattr(args, name, None)
        if isinstance(value, str) and value in words:
            setattr(args, name, words[value])


def model_word(argv: list[str]) -> list[str]:
    """`serve MODEL ...` (vLLM's `vllm serve MODEL`) as `serve --model MODEL ...`."""
    if len(argv) < 2 or argv[1].startswith("-"):
        return argv
    if any(a == "--model" or a.startswith("--model=") for a in argv[2:]):
        raise SystemExit(f"tidal {argv[0]}: error: the model is given twice ({argv[1]!r} and "
                         f"--model): give it once")
    return [argv[0], "--model", *argv[1:]]


def expand_config_file(argv: list[str]) -> list[str]:
    """argv with `--config FILE` replaced by the file's flags, put first so that the
    command line's own win (argparse keeps a flag's last value)."""
    if "--config" not in argv and not any(a.startswith("--config=") for a in argv):
        return argv
    out, path, i = [], None, 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--config" and i + 1 < len(argv):
            path, i = argv[i + 1], i + 2
            continue
        if arg.startswith("--config="):
            path = arg.split("=", 1)[1]
        else:
            out.append(arg)
        i += 1
    if path is None:
        return argv  # argparse says --config needs its value
    return out[:1] + config_file_flags(path) + out[1:]  # after the subcommand


def config_file_flags(path: str) -> list[str]:
    """A vLLM YAML config's keys as flags: true a switch, false `--no-` (a switch off), a
    list its words, a mapping JSON."""
    import yaml

    try:
        data = yaml.safe_load(Path(path).read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise SystemExit(f"tidal: error: --config {path}: {exc}") from None
    if not isinstance(data, dict):
        raise SystemExit(f"tidal: error: --config {path}: a mapping of flags to values")
    flags: list[str] = []
    for key, value in data.items():
        flag = "--" + str(key).replace("_", "-")
        if value is True:
            flags.append(flag)
        elif value is False:  # a switch of another engine's off asks for nothing
            flags += [] if flag in NOTHING_WHEN_OFF else [f"--no-{flag[2:]}"]
        elif isinstance(value, list):
            flags += [flag, *map(str, value)]
        elif isinstance(value, dict):
            flags += [flag, json.dumps(value)]
        elif value is not None:
            flags += [flag, str(value)]
    return flags
