"""Counts of the core classes' size, side by side for source trees: `Request` fields,
`Scheduler.schedule` branch points and lines, `EngineCore` and `Router` methods, and
the largest production modules. Read from the source (ast), nothing imported, so a tree
of any age can be measured, e.g. one made by `git archive REV | tar -x -C DIR`.

    python -m benchmarks.codebase shape --trees /tmp/before .
"""

from __future__ import annotations

import argparse
import ast
from pathlib import Path

# The production packages (tests and benchmarks are not counted).
PACKAGES = ("engine", "router", "decode_worker", "prefill_worker", "kv_transfer", "protocol", "cluster", "security",
            "workers")
LINE_LIMIT = 400
BRANCHES = (ast.If, ast.IfExp, ast.For, ast.While, ast.BoolOp, ast.Try)


def _class(root: Path, path: str, name: str) -> ast.ClassDef:
    tree = ast.parse((root / path).read_text())
    return next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == name)


def _methods(cls: ast.ClassDef) -> list[ast.FunctionDef | ast.AsyncFunctionDef]:
    return [n for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]


def shape(root: Path) -> dict[str, object]:
    request = _class(root, "engine/request.py", "Request")
    schedule = next(m for m in _methods(_class(root, "engine/scheduler.py", "Scheduler")) if m.name == "schedule")
    files = sorted(((len(p.read_text().splitlines()), str(p.relative_to(root)))
                    for package in PACKAGES for p in (root / package).rglob("*.py")), reverse=True)
    return {
        "Request fields": sum(isinstance(n, ast.AnnAssign) for n in request.body),
        "schedule(): branch points (if, ternary, loop, and/or, try)": sum(isinstance(n, BRANCHES)
                                                                          for n in ast.walk(schedule)),
        "schedule(): if and ternary": sum(isinstance(n, (ast.If, ast.IfExp)) for n in ast.walk(schedule)),
        "schedule(): lines": (schedule.end_lineno or schedule.lineno) - schedule.lineno + 1,
        "EngineCore methods": len(_methods(_class(root, "engine/engine_core.py", "EngineCore"))),
        "Router methods": len(_methods(_class(root, "router/core.py", "Router"))),
        f"production modules over {LINE_LIMIT} lines": sum(n > LINE_LIMIT for n, _ in files),
        "largest modules": ", ".join(f"{name} {n}" for n, name in files[:3]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trees", nargs="+", type=Path, default=[Path(".")], help="source trees, side by side")
    args = parser.parse_args()
    shapes = [shape(tree) for tree in args.trees]
    print("| count | " + " | ".join(str(t) for t in args.trees) + " |")
    print("|---" * (len(args.trees) + 1) + "|")
    for key in shapes[0]:
        print(f"| {key} | " + " | ".join(str(s[key]) for s in shapes) + " |")


if __name__ == "__main__":
    main()
