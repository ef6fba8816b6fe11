"""benchmarks/codebase/shape.py counts what it says, on a made-up tree."""

from __future__ import annotations

from pathlib import Path

from benchmarks.codebase.shape import shape

SOURCES = {
    "engine/request.py": "class Request:\n    a: int\n    b: str = ''\n    def f(self): pass\n",
    "engine/scheduler.py": ("class Scheduler:\n    def schedule(self):\n        for x in y:\n"
                            "            if a and b:\n                pass\n        return 1 if c else 2\n"),
    "engine/engine_core.py": "class EngineCore:\n    def a(self): pass\n    async def b(self): pass\n",
    "router/core.py": "class Router:\n    def a(self): pass\n" + "\n" * 400,
}


def test_the_counts_of_a_small_tree(tmp_path: Path) -> None:
    for path, text in SOURCES.items():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(text)
    counts = shape(tmp_path)
    assert counts["Request fields"] == 2
    assert counts["schedule(): branch points (if, ternary, loop, and/or, try)"] == 4  # for, if, and, ternary
    assert counts["schedule(): if and ternary"] == 2
    assert counts["schedule(): lines"] == 5
    assert (counts["EngineCore methods"], counts["Router methods"]) == (2, 1)
    assert counts["production modules over 400 lines"] == 1
    assert str(counts["largest modules"]).startswith("router/core.py 402")
