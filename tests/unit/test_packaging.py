"""Every production package is installed and type-checked: `pdserve serve` runs from the
installed console script, outside the repo root, so a package missing from
pyproject.toml's include list fails at import (kv_store/ once did)."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
NOT_SHIPPED = {"tests", "benchmarks"}


def test_every_top_level_package_is_installed_and_type_checked() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    include = config["tool"]["setuptools"]["packages"]["find"]["include"]
    checked = set(config["tool"]["mypy"]["packages"])
    packages = {p.parent.name for p in ROOT.glob("*/__init__.py")} - NOT_SHIPPED
    assert packages, "no packages found"
    assert {p for p in packages if f"{p}*" not in include} == set()
    assert packages - checked == set()
