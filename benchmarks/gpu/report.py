"""The GPU check's rows: each section appends its checks here, and the run ends with
them as one markdown table."""

from __future__ import annotations

import re
import time
import traceback
from collections.abc import Callable

ROWS: list[tuple[str, str, str, str]] = []  # (check, measured, target, verdict)
# A target on a rate, a time or a ratio of them ("<= 1.5x", ">= 70%", "<= 50 us"), as
# opposed to one on correctness ("bit-exact", "identical", "<= 1e-2").
_TIMING_TARGET = re.compile(r"\d\s*(x|%|us|ms|s|[GT]B/s|TFLOP/s)$")
_judge_timings = True


def judge_timings(on: bool) -> None:
    """Off for the CPU smoke run: its timings say nothing of the GPU's, so their rows
    show "(not judged)" and only correctness and errors can fail the run."""
    global _judge_timings
    _judge_timings = on


def row(check: str, measured: str, target: str = "", ok: bool | None = None) -> None:
    if ok is not None and not _judge_timings and _TIMING_TARGET.search(target):
        verdict = "(not judged)"
    else:
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
    unjudged = sum(r[3] == "(not judged)" for r in ROWS)
    print(f"\n{len(ROWS) - len(failed) - unjudged} passed, {len(failed)} failed"
          + (f", {unjudged} timings not judged" if unjudged else ""))
    return len(failed)
