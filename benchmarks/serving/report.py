"""A run's summary (vLLM `bench serve`'s definitions), its one printed line, and the
JSON it is written as. A value with no data behind it (percentiles of no request, the
KV transfer of a run without remote prefill) is NaN in memory and null in the JSON."""

from __future__ import annotations

import json
import math
import statistics
from typing import Any

from benchmarks.serving.load import Result


def percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {"p50": float("nan"), "p90": float("nan"), "p99": float("nan")}
    qs = statistics.quantiles(values, n=100, method="inclusive") if len(values) > 1 else values * 99
    return {"p50": qs[49], "p90": qs[89], "p99": qs[98]}


def summarize(results: list[Result], elapsed: float, slo_ttft: float, slo_tpot: float) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    tpots = [r.tpot for r in ok if r.tpot is not None]
    good = [r for r in ok if r.ttft <= slo_ttft and (r.tpot or 0.0) <= slo_tpot]
    return {
        "requests": len(results), "completed": len(ok), "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if r.error})[:5], "seconds": elapsed,
        "request_throughput": len(ok) / elapsed, "output_throughput": sum(r.output_tokens for r in ok) / elapsed,
        "goodput": len(good) / elapsed,
        "ttft": percentiles([r.ttft for r in ok]), "tpot": percentiles(tpots),
        "itl": percentiles([x for r in ok for x in r.itl]), "e2e": percentiles([r.e2e for r in ok]),
    }


def finite_or_none(value: Any) -> Any:
    """value with every NaN or infinite float, however deep in dicts and lists, as None."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite_or_none(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_or_none(v) for v in value]
    return value


def json_text(report: dict[str, Any]) -> str:
    """The report as strict JSON (RFC 8259 has no NaN): a value with no data is null."""
    return json.dumps(finite_or_none(report), indent=1, allow_nan=False)


def known(value: float | None) -> bool:
    """A value read from memory (NaN when unknown) or from the JSON (null)."""
    return value is not None and not math.isnan(value)


def number(value: float | None, scale: float = 1.0, digits: int = 2) -> str:
    """value * scale with `digits` decimals, or "-" if unknown."""
    return f"{value * scale:.{digits}f}" if known(value) else "-"


def _ms(p: dict[str, float | None]) -> str:
    return f"{number(p['p50'], 1e3, 0)}/{number(p['p90'], 1e3, 0)}/{number(p['p99'], 1e3, 0)} ms"


def _phase(title: str, kv: dict[str, float | None] | None) -> str:
    return ("" if not kv or not kv["count"] or not known(kv["mean"]) else
            f" | {title} mean/p50/p99 {kv['mean'] * 1e3:.1f}/{number(kv['p50'], 1e3, 1)}/"
            f"{number(kv['p99'], 1e3, 1)} ms over {kv['count']:.0f}")


def line(label: str, s: dict[str, Any]) -> str:
    transfer = _phase("KV transfer", s.get("kv_transfer")) + _phase("hop", s.get("kv_hop"))
    return (f"{label}: {s['completed']}/{s['requests']} ok, {s['request_throughput']:.2f} req/s, "
            f"{s['output_throughput']:.1f} output tok/s, goodput {s['goodput']:.2f} req/s | "
            f"TTFT p50/p90/p99 {number(s['ttft']['p50'], 1, 2)}/{number(s['ttft']['p90'], 1, 2)}/"
            f"{number(s['ttft']['p99'], 1, 2)} s | "
            f"TPOT {_ms(s['tpot'])} | ITL {_ms(s['itl'])}" + transfer
            + (f" | errors: {s['errors']}" if s["errors"] else ""))
