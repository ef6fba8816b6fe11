"""The one entry point each benchmark group has: `python -m benchmarks.<group> NAME [ARGS]`.

Each group's __main__.py names its benchmarks (NAME -> module) and calls `run_group`;
benchmarks/README.md says which command makes which table in docs/benchmarks/. With no
NAME (or -h, --help, list) it prints the group's benchmarks, each with the first sentence
of its docstring, read from the source so that nothing heavy is imported.

NAME replaces this process (exec) with `python -m MODULE ARGS`, so a benchmark runs
exactly as it would started by hand: its own `__main__`, its own argument parser, and
spawned children (multiprocessing's spawn re-imports the main module by name) that find
it. The repository root is added to PYTHONPATH first, for those children and for
subprocesses that run files.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import sys
from collections.abc import Mapping
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


def summary(module: str, width: int = 100) -> str:
    """The first sentence of `module`'s docstring, at most `width` characters, without
    importing it ('' if it has none)."""
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        raise LookupError(f"no module {module}")
    origin = Path(spec.origin)
    if origin.name == "__init__.py" and (origin.parent / "__main__.py").exists():
        origin = origin.parent / "__main__.py"  # a package run with -m: its __main__ speaks for it
    doc = ast.get_docstring(ast.parse(origin.read_text(), str(origin))) or ""
    sentence = " ".join(doc.strip().split("\n\n")[0].split()).split(". ")[0].rstrip(".:")
    return sentence if len(sentence) <= width else sentence[:width - 3].rstrip() + "..."


def usage(group: str, benchmarks: Mapping[str, str]) -> str:
    width = max(map(len, benchmarks))
    lines = [f"usage: python -m {group} NAME [ARGS]  (NAME --help: its own options)", "", "NAME:"]
    lines += [f"  {name:<{width}}  {summary(module)}" for name, module in benchmarks.items()]
    return "\n".join(lines)


def run_group(group: str, benchmarks: Mapping[str, str], argv: list[str] | None = None) -> None:
    """Run the benchmark argv[0] names with the rest of argv; list them if there is none."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help", "list"):
        print(usage(group, benchmarks))
        raise SystemExit(0)
    name, rest = argv[0], argv[1:]
    if name not in benchmarks:
        print(f"python -m {group}: error: no benchmark {name!r}; choose from {', '.join(benchmarks)}",
              file=sys.stderr)
        raise SystemExit(2)
    paths = [str(REPO_ROOT), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(dict.fromkeys(paths))}
    sys.stdout.flush()
    os.execve(sys.executable, [sys.executable, "-m", benchmarks[name], *rest], env)
