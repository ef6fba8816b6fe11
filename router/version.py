"""pdserve's version, for GET /version: the installed package's metadata, or, run from a
source tree that was never installed, its pyproject.toml."""

from __future__ import annotations

import functools
import importlib.metadata
import tomllib
from pathlib import Path

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


@functools.cache
def pdserve_version() -> str:
    try:
        return importlib.metadata.version("pdserve")
    except importlib.metadata.PackageNotFoundError:
        return str(tomllib.loads(PYPROJECT.read_text())["project"]["version"])
