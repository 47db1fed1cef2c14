"""Fetch the wheels tidal needs on a GPU machine that cannot reach a package index.

usage: python benchmarks/gpu_wheels.py --have FILE [--dest DIR] [--python-version 3.12]
           [--glibc 35] [--also openai rich] [--dry-run]

Walks tidal's runtime requirements (and the `--also` names: `benchmarks/gpu_serve.py`'s
`transformers serve` needs openai and rich) through this environment's installed
distributions, drops those FILE names (the target's `pip freeze` or `pip list`, or one name
a line) and the target's own torch, triton and CUDA libraries, and downloads each left at
this environment's version as a binary wheel for the target's CPython on manylinux x86-64.
On the target: `pip install --no-index --no-deps --target SITE DIR/*.whl` and put SITE on
PYTHONPATH; then `benchmarks/gpu_check.sh` runs.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from importlib.metadata import PackageNotFoundError, distribution
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

# The target's own builds: a wheel from here would shadow its CUDA torch.
NEVER = re.compile(r"^(torch|triton|nvidia-.*|cuda-.*)$")


def read_have(path: Path) -> set[str]:
    """Names from `pip freeze` (name==version), `pip list` (name version) or a bare list."""
    names = set()
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith(("#", "Package", "---")):
            continue
        names.add(canonicalize_name(re.split(r"[=<>@ ]", line, maxsplit=1)[0]))
    return names


def closure(roots: list[str], have: set[str]) -> dict[str, str]:
    """name -> installed version of every distribution the roots need that the target lacks."""
    needed: dict[str, str] = {}
    todo = list(roots)
    while todo:
        name = canonicalize_name(todo.pop())
        if name in needed or name in have or NEVER.match(name):
            continue
        try:
            dist = distribution(name)
        except PackageNotFoundError:
            sys.exit(f"{name} is not installed here: install tidal's dependencies first "
                     "(make install)")
        needed[name] = dist.version
        for text in dist.requires or []:
            req = Requirement(text)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return needed


def tidal_roots() -> list[str]:
    requirements = map(Requirement, distribution("tidal").requires or [])
    return [req.name for req in requirements if req.marker is None]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--have", type=Path, required=True,
                        help="the target's `pip freeze` / `pip list`: these are not fetched")
    parser.add_argument("--dest", type=Path, default=Path("wheels"))
    parser.add_argument("--python-version", default="3.12")
    parser.add_argument("--glibc", type=int, default=35,
                        help="the target's glibc minor version (2.35: Ubuntu 22.04); wheels "
                        "built for any manylinux_2_N with N up to it are taken")
    parser.add_argument("--also", nargs="*", default=["openai", "rich"],
                        help="more distributions to carry beside tidal's own requirements")
    parser.add_argument("--dry-run", action="store_true", help="print the list, fetch nothing")
    args = parser.parse_args()
    needed = closure(tidal_roots() + args.also, read_have(args.have))
    pins = [f"{name}=={version}" for name, version in sorted(needed.items())]
    print("\n".join(pins))
    if args.dry_run or not pins:
        return
    tags = ["manylinux1_x86_64", "manylinux2014_x86_64"]  # pip matches each tag exactly
    tags += [f"manylinux_2_{n}_x86_64" for n in range(5, args.glibc + 1)]
    platforms = [flag for tag in tags for flag in ("--platform", tag)]
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                    "--only-binary=:all:", "--implementation", "cp", "--python-version",
                    args.python_version, *platforms, "-d", str(args.dest), *pins], check=True)
    print(f"{len(pins)} wheels in {args.dest}")


if __name__ == "__main__":
    main()
