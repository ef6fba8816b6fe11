"""The packages' import arrows point down, and no two packages import each other.

Every import counts, at module level or inside a function (a lazy import is still a
dependency), and so does a module named in a string for importlib ("pkg.module" or
"pkg.module:Name", as the lazy registries write them). The allowed arrows are
docs/architecture.md's layer table.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# package -> the packages it may import. Ground floor first.
ALLOWED: dict[str, set[str]] = {
    "engine": set(),
    "protocol": {"engine"},  # Generate carries engine.sampling_params.SamplingParams
    "security": set(),
    "kv_transfer": {"protocol", "security"},  # its control messages are protocol/kv_control.py's
    "kv_store": {"engine", "protocol", "security"},  # the client is the engine's SharedTier
    "workers": {"engine", "kv_transfer", "kv_store", "protocol", "security"},
    "decode_worker": {"engine", "kv_transfer", "protocol", "security", "workers"},
    "prefill_worker": {"engine", "kv_transfer", "protocol", "security", "workers"},
    "router": {"engine", "protocol", "security"},
    "cluster": {"engine", "kv_transfer", "kv_store", "protocol", "security", "workers", "decode_worker",
                "prefill_worker", "router"},
}


MODULE_NAME = re.compile(rf"^({'|'.join(ALLOWED)})(\.[A-Za-z_]\w*)+(:[A-Za-z_]\w*)?$")


def imports_of(package: str) -> dict[str, set[str]]:
    """Our packages each module of `package` imports -> the modules that do."""
    found: dict[str, set[str]] = {}
    for path in sorted((REPO / package).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and MODULE_NAME.match(node.value):
                names = [node.value]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top in ALLOWED and top != package:
                    found.setdefault(top, set()).add(str(path.relative_to(REPO)))
    return found


def test_every_import_points_down() -> None:
    wrong = [f"{package} -> {target} (in {', '.join(sorted(where))})"
             for package in ALLOWED for target, where in imports_of(package).items()
             if target not in ALLOWED[package]]
    assert wrong == []


def test_the_allowed_arrows_have_no_cycle() -> None:
    done: set[str] = set()

    def visit(package: str, path: tuple[str, ...]) -> None:
        assert package not in path, f"cycle: {' -> '.join(path + (package,))}"
        if package not in done:
            for target in ALLOWED[package]:
                visit(target, path + (package,))
            done.add(package)

    for package in ALLOWED:
        visit(package, ())
