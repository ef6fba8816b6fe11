"""The GPU check's rows: each section appends its checks here, and the run ends with
them as one markdown table."""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable

ROWS: list[tuple[str, str, str, str]] = []  # (check, measured, target, verdict)


def row(check: str, measured: str, target: str = "", ok: bool | None = None) -> None:
    verdict = "" if ok is None else ("ok" if ok else "FAIL")
    ROWS.append((check, measured, target, verdict))
    print(f"  {check}: {measured} {target} {verdict}", flush=True)


def section(name: str, fn: Callable[[], None]) -> None:
    print(f"[{name}]", flush=True)
    start = time.perf_counter()
    try:
        fn()
    except Exception as exc:  # one broken section must not hide the others' numbers
        traceback.print_exc()
        row(name, f"{type(exc).__name__}: {exc}"[:120], "", False)
    print(f"  ({time.perf_counter() - start:.1f} s)", flush=True)


def print_table() -> int:
    """Print every row as a markdown table and the tally; returns how many failed."""
    widths = [max(len(r[i]) for r in ROWS) for i in range(4)] if ROWS else [0] * 4
    print("\n| check | measured | target | |\n|---|---|---|---|")
    for r in ROWS:
        print("| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |")
    failed = [r for r in ROWS if r[3] == "FAIL"]
    print(f"\n{len(ROWS) - len(failed)} passed, {len(failed)} failed")
    return len(failed)
