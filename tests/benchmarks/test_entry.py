"""benchmarks/<group>/__main__.py, each group's one entry point: every benchmark script
is listed in its group, every listed module exists, every `python -m benchmarks.GROUP
NAME` quoted in the docs names a real one, and a wrong name is refused by name."""

from __future__ import annotations

import ast
import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.entry import summary, usage

ROOT = Path(__file__).resolve().parents[2]
# Test beds with verbs of their own (`up`, `down`), not groups of benchmarks.
TOOLS = {"netns_cluster"}
GROUPS = sorted(p.parent.name for p in (ROOT / "benchmarks").glob("*/__main__.py") if p.parent.name not in TOOLS)
QUOTED = re.compile(r"-m benchmarks\.([a-z0-9_]+) ([a-z0-9_]+)")  # GROUP NAME in prose is a placeholder


def group_benchmarks(group: str) -> dict[str, str]:
    return importlib.import_module(f"benchmarks.{group}.__main__").BENCHMARKS


def is_script(path: Path) -> bool:
    """A module with an `if __name__ == "__main__":` block: something to run."""
    tree = ast.parse(path.read_text())
    return any(isinstance(node, ast.If) and "__main__" in ast.unparse(node.test) for node in tree.body)


def test_the_groups_are_the_issue_s():
    # Issue 35's seven, and the counts of the code's own shape that it asked for.
    assert GROUPS == ["chaos", "codebase", "elastic", "fuzz", "gpu", "kv", "offline", "serving"]


@pytest.mark.parametrize("group", GROUPS)
def test_every_script_of_a_group_is_in_its_entry_point(group):
    listed = set(group_benchmarks(group).values())
    folder = ROOT / "benchmarks" / group
    scripts = {f"benchmarks.{group}.{p.stem}" for p in folder.glob("*.py")
               if p.name not in ("__init__.py", "__main__.py") and is_script(p)}
    scripts |= {f"benchmarks.{group}.{p.parent.name}" for p in folder.glob("*/__main__.py")}
    assert scripts <= listed, f"not in benchmarks/{group}/__main__.py: {sorted(scripts - listed)}"
    for module in listed:
        assert summary(module), f"{module} has no docstring to list"


def test_every_quoted_command_names_a_benchmark():
    docs = [ROOT / "README.md", ROOT / "Makefile", ROOT / "benchmarks" / "README.md",
            *(ROOT / "docs").rglob("*.md")]
    quoted = {(path.relative_to(ROOT), group, name) for path in docs
              for group, name in QUOTED.findall(path.read_text())}
    assert len(quoted) > 30  # the docs quote most of them: a broken pattern finds none
    wrong = [(str(path), f"{group} {name}") for path, group, name in sorted(quoted)
             if group not in TOOLS and (group not in GROUPS or name not in group_benchmarks(group))]
    assert not wrong, wrong


def test_no_name_lists_the_group_and_a_wrong_one_is_refused():
    assert "transfer" in usage("benchmarks.kv", group_benchmarks("kv"))
    run = subprocess.run([sys.executable, "-m", "benchmarks.kv", "bandwidth"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 2
    assert "no benchmark 'bandwidth'; choose from transfer, tp_transfer, nccl_rendezvous" in run.stderr
