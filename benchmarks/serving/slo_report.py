"""benchmarks/serving/slo.py's tables: medians over seeds of each run's figures, the
goodput ratio of each arm to fcfs per (topology, load), and the noisy neighbour's
quiet-key p99 TTFT ratios. Runs are the JSON's dicts, so a saved report re-tables."""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Iterable
from typing import Any

from benchmarks.serving.report import number

Run = dict[str, Any]
ARM_ORDER = {"fcfs": 0, "slo": 1, "best_effort": 2}


def median(values: Iterable[float | None]) -> float:
    """The median of the known values (NaN if none is): a run with no completed request
    has no TTFT, and must not make the others' median unknown."""
    known = [v for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    return statistics.median(known) if known else float("nan")


def ratio(num: float, den: float) -> float:
    if math.isnan(num) or math.isnan(den) or den == 0:
        return float("nan")
    return num / den


def prediction_p50(run: Run) -> float | None:
    """The predictor's p50 |TTFT error| (seconds) /status reported right after the run."""
    return (((run.get("prediction_error") or {}).get("ttft") or {}).get("p50_s"))


FIGURES: dict[str, Callable[[Run], float | None]] = {
    "goodput": lambda r: r["goodput"],
    "throughput": lambda r: r["throughput"],
    "rejected": lambda r: r["rejected"],
    "ttft_p50": lambda r: r["ttft"]["p50"],
    "ttft_p99": lambda r: r["ttft"]["p99"],
    "prediction_p50": prediction_p50,
}


def medians(runs: list[Run]) -> list[Run]:
    """One row per (topology, load, arm), in first-seen order: the median over seeds of
    each figure, and goodput's ratio to the fcfs arm's median at the same (topology, load)."""
    groups: dict[tuple[str, float, str], list[Run]] = {}
    for run in runs:
        groups.setdefault((run["topology"], run["load"], run["arm"]), []).append(run)
    rows = [{"topology": t, "load": load, "arm": arm, "seeds": len(group),
             **{name: median(f(r) for r in group) for name, f in FIGURES.items()}}
            for (t, load, arm), group in groups.items()]
    fcfs = {(r["topology"], r["load"]): r["goodput"] for r in rows if r["arm"] == "fcfs"}
    for row in rows:
        row["vs_fcfs"] = ratio(row["goodput"], fcfs.get((row["topology"], row["load"]), float("nan")))
    return sorted(rows, key=lambda r: (r["topology"], r["load"], ARM_ORDER.get(r["arm"], 9)))


def table(rows: list[Run]) -> str:
    """The markdown table of medians(runs)."""
    out = ["| topology | load | arm | goodput req/s | throughput req/s | rejected | TTFT p50 ms | TTFT p99 ms "
           "| pred. TTFT err p50 ms | goodput / fcfs |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['topology']} | {r['load']:g}x | {r['arm']} | {number(r['goodput'])} "
                   f"| {number(r['throughput'])} | {number(r['rejected'], digits=0)} | {number(r['ttft_p50'], 1000, 0)} "
                   f"| {number(r['ttft_p99'], 1000, 0)} | {number(r['prediction_p50'], 1000, 0)} "
                   f"| {number(r['vs_fcfs'])}x |")
    return "\n".join(out)


def noisy_rows(runs: list[Run]) -> list[Run]:
    """Per arm: the quiet key's p99 TTFT (median over seeds) alone and with the noisy
    key, and each's ratio to the fair arm's alone figure (the issue's target: fair with
    noisy / alone <= 1.5)."""
    def p99(arm: str, phase: str) -> float:
        return median(r["quiet"]["ttft"]["p99"] for r in runs if r["arm"] == arm and r["phase"] == phase)

    def figure(arm: str, phase: str, f: Callable[[Run], float]) -> float:
        return median(f(r) for r in runs if r["arm"] == arm and r["phase"] == phase)

    alone = p99("fair", "alone")
    rows = [{"arm": "alone", "quiet_ttft_p99": alone, "vs_alone": ratio(alone, alone),
             "quiet_goodput": figure("fair", "alone", lambda r: r["quiet"]["goodput"]),
             "quiet_rejected": figure("fair", "alone", lambda r: r["quiet"]["rejected"]),
             "noisy_rejected": float("nan"), "noisy_throughput": float("nan")}]
    for arm in ("fair", "fcfs"):
        with_noisy = p99(arm, "noisy")
        rows.append({"arm": f"{arm} + noisy", "quiet_ttft_p99": with_noisy, "vs_alone": ratio(with_noisy, alone),
                     "quiet_goodput": figure(arm, "noisy", lambda r: r["quiet"]["goodput"]),
                     "quiet_rejected": figure(arm, "noisy", lambda r: r["quiet"]["rejected"]),
                     "noisy_rejected": figure(arm, "noisy", lambda r: r["noisy"]["rejected"]),
                     "noisy_throughput": figure(arm, "noisy", lambda r: r["noisy"]["throughput"])})
    return rows


def noisy_table(rows: list[Run]) -> str:
    out = ["| quiet key | p99 TTFT ms | / alone | quiet goodput req/s | quiet rejected | noisy rejected "
           "| noisy throughput req/s |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['arm']} | {number(r['quiet_ttft_p99'], 1000, 0)} | {number(r['vs_alone'])}x "
                   f"| {number(r['quiet_goodput'])} | {number(r['quiet_rejected'], digits=0)} "
                   f"| {number(r['noisy_rejected'], digits=0)} | {number(r['noisy_throughput'])} |")
    return "\n".join(out)
