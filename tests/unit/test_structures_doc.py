"""docs/structures.md, the newcomer's map of the code, lists every production module once.

A production module is a tracked `*.py` file outside tests/ and benchmarks/ (from `git
ls-files`; where git cannot answer, a walk of the packages). The map names each on one
list item, `- \`path\`: what it does.`; a map that misses a new module, or still names
a removed one, misleads exactly the reader it is for, so this test fails naming both,
and refuses a module listed twice or with nothing said about it.
"""

from __future__ import annotations

import re
import subprocess
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "structures.md"
EXCLUDED = ("tests", "benchmarks")
# A module's line: `- `path`: description`; the description may end with "Key types: ...".
ITEM = re.compile(r"^- `([^`]+)`:(.*)$")


def _is_production(path: str) -> bool:
    return path.endswith(".py") and path.split("/")[0] not in EXCLUDED


def production_modules() -> set[str]:
    """Repo-relative paths of the production modules: git's tracked files, or, without
    git (or outside a checkout), every *.py of the top-level packages and the top level."""
    try:
        listed = subprocess.run(["git", "ls-files", "*.py"], cwd=REPO, capture_output=True, text=True,
                                check=True, timeout=60).stdout.split()
    except (OSError, subprocess.SubprocessError):
        listed = []
    if listed:
        return {path for path in listed if _is_production(path)}
    found = {path.name for path in REPO.glob("*.py")}
    for package in REPO.iterdir():
        if package.is_dir() and (package / "__init__.py").is_file() and package.name not in EXCLUDED:
            found.update(str(path.relative_to(REPO)) for path in package.rglob("*.py")
                         if "__pycache__" not in path.parts)
    return {path for path in found if _is_production(path)}


def doc_items() -> list[tuple[str, str]]:
    """(path, description) of every module line of the map, in order."""
    items = []
    for line in DOC.read_text().splitlines():
        match = ITEM.match(line)
        if match:
            items.append((match.group(1), match.group(2).strip()))
    return items


def test_the_map_lists_every_production_module_and_nothing_else() -> None:
    modules = production_modules()
    assert modules, "found no production modules: is the repository root right?"
    listed = {path for path, _ in doc_items()}
    missing = sorted(modules - listed)
    stale = sorted(listed - modules)
    assert not missing and not stale, (
        f"docs/structures.md is out of date.\n  missing (add a line each): {missing}\n"
        f"  stale (no such module; remove them): {stale}")


def test_no_module_is_listed_twice() -> None:
    twice = sorted(path for path, count in Counter(path for path, _ in doc_items()).items() if count > 1)
    assert twice == [], f"docs/structures.md lists these more than once: {twice}"


def test_every_module_line_says_what_it_does() -> None:
    # The job comes first; "Key types: ..." alone says nothing about what the module does.
    empty = sorted(path for path, description in doc_items()
                   if not description.split("Key types:")[0].strip(" ."))
    assert empty == [], f"docs/structures.md has no description for: {empty}"


# A file past this many lines has become two jobs (issue 35 split engine_core.py at 600,
# scheduler.py at 527 and router/core.py at 441); split it rather than raise the limit.
MAX_MODULE_LINES = 400


def test_no_production_module_is_over_the_line_limit() -> None:
    long = sorted(f"{path} ({count} lines)" for path in production_modules()
                  if (count := len((REPO / path).read_text().splitlines())) > MAX_MODULE_LINES)
    assert long == [], f"production modules over {MAX_MODULE_LINES} lines (split each by job): {long}"
