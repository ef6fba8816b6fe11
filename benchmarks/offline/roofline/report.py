"""The roofline report: each measured step beside its analytic floor, as rows (the
JSON's shape, which the plots read back) and as a markdown table."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from benchmarks.offline.roofline.analytic import ModelShape, Step, StepCost, step_cost
from benchmarks.offline.roofline.measure import Measured
from benchmarks.offline.roofline.roofs import Roof


def floor_row(shape: ModelShape, width: int, roof: Roof, kind: str, batch: int, new_tokens: int,
              context: int, timed_contexts: Sequence[int] = (), measured_s: float | None = None) -> dict[str, Any]:
    """One row: the floor is the mean over the timed steps' contexts (default: context)."""
    costs = [step_cost(shape, Step(batch, new_tokens, c), width) for c in (timed_contexts or (context,))]
    floor = statistics.fmean(c.floor(roof) for c in costs)
    mid = costs[len(costs) // 2]
    return {
        "kind": kind, "batch": batch, "new_tokens": new_tokens, "context": context,
        "measured_s": measured_s, "floor_s": floor,
        "whole_step_floor_s": statistics.fmean(c.whole_step_floor(roof) for c in costs),
        "ratio": None if measured_s is None else measured_s / floor,
        "bound": mid.bound(roof),
        "bytes": statistics.fmean(c.bytes for c in costs), "flops": statistics.fmean(c.flops for c in costs),
        "classes": _classes(costs, roof),
    }


def _classes(costs: list[StepCost], roof: Roof) -> dict[str, dict[str, Any]]:
    mid = costs[len(costs) // 2]
    return {c.name: {"bytes": c.bytes, "flops": c.flops, "floor_s": c.floor(roof), "bound": c.bound(roof)}
            for c in mid.classes}


def measured_rows(shape: ModelShape, width: int, roof: Roof, measured: Sequence[Measured]) -> list[dict[str, Any]]:
    return [floor_row(shape, width, roof, m.kind, m.batch, m.new_tokens, m.context, m.timed_contexts, m.seconds)
            for m in measured]


def analytic_rows(shape: ModelShape, width: int, roof: Roof, batches: Sequence[int], contexts: Sequence[int],
                  chunk: int, prefill_context: int) -> list[dict[str, Any]]:
    """The floors alone, for the same grid as a measured run."""
    rows = [floor_row(shape, width, roof, "decode", b, 1, c) for c in contexts for b in batches]
    return rows + [floor_row(shape, width, roof, "prefill", 1, chunk, prefill_context)]


def make_report(model: str, device: str, dtype: str, shape: ModelShape, roof: Roof,
                rows: list[dict[str, Any]], note: str = "") -> dict[str, Any]:
    return {"model": model, "device": device, "dtype": dtype, "shape": asdict(shape),
            "roof": asdict(roof), "note": note, "rows": rows}


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.2f}"


def format_table(report: dict[str, Any]) -> str:
    lines = ["| step | batch | context | measured ms | floor ms | measured / floor | bound "
             "| whole-step floor ms | largest class |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in report["rows"]:
        step = "decode" if r["kind"] == "decode" else f"prefill {r['new_tokens']}"
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.2f}x"
        name, top = max(r["classes"].items(), key=lambda kv: kv[1]["floor_s"])
        lines.append(f"| {step} | {r['batch']} | {r['context']} | {_ms(r['measured_s'])} | {_ms(r['floor_s'])} "
                     f"| {ratio} | {r['bound']} | {_ms(r['whole_step_floor_s'])} "
                     f"| {name} {100 * top['floor_s'] / r['floor_s']:.0f}% |")
    return "\n".join(lines)
