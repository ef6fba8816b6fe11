"""P5 and P6 from two benchmarks/serving/serve.py JSONs, a disaggregated and a colocated run of
the same command (same seeds, same load points):

  P5  TTFT ratio, disaggregated / colocated, at the low load point (target <= 1.15)
  P6  p99 TPOT ratio at the high load point (target <= 0.5), with both setups'
      throughputs beside it, since the target holds "at equal throughput"

Each ratio per seed, then pooled (the percentile of every request of every seed), with
the spread (min-max) of the per-seed ratios. The ratios are of completed requests only,
so a load point where any request failed (a refusal, a timeout) gets no verdict: the
survivors of an overloaded setup are not its latency. Two reports of different
commands are refused (compare_inputs.py)."""

from __future__ import annotations

import math
from typing import Any

from benchmarks.serving.compare_inputs import check_same_command
from benchmarks.serving.report import percentiles

NO_VERDICT = "no verdict"


def load_point(run: dict[str, Any]) -> str:
    return f"rate {run['rate']}/s" if run["load"] == "poisson" else f"concurrency {run['concurrency']}"


def _runs(report: dict[str, Any], point: str) -> dict[int, dict[str, Any]]:
    return {run["seed"]: run for run in report["runs"] if load_point(run) == point}


def _values(runs: list[dict[str, Any]], metric: str) -> list[float]:
    out = []
    for run in runs:
        for r in run["results"]:
            if not r["ok"]:
                continue
            if metric == "ttft":
                out.append(r["ttft"])
            elif r["output_tokens"] > 1:
                out.append((r["e2e"] - r["ttft"]) / (r["output_tokens"] - 1))
    return out


def common_points(disagg: dict[str, Any], coloc: dict[str, Any]) -> list[str]:
    """Load points both files ran, with the same seeds, in the disaggregated file's order."""
    theirs = {load_point(run) for run in coloc["runs"]}
    points = list(dict.fromkeys(load_point(run) for run in disagg["runs"]))
    return [p for p in points if p in theirs and set(_runs(disagg, p)) == set(_runs(coloc, p))]


def ratio_rows(disagg: dict[str, Any], coloc: dict[str, Any], point: str, metric: str,
               stat: str) -> dict[str, Any]:
    """`stat` (p50/p99) of `metric` (ttft/tpot), disaggregated over colocated: per seed,
    pooled, and the per-seed spread; throughputs (req/s) of each setup per seed."""
    d, c = _runs(disagg, point), _runs(coloc, point)
    seeds = sorted(d)
    per_seed = {}
    for seed in seeds:
        a, b = percentiles(_values([d[seed]], metric))[stat], percentiles(_values([c[seed]], metric))[stat]
        per_seed[seed] = (a, b, a / b if b > 0 else math.nan)
    a = percentiles(_values([d[s] for s in seeds], metric))[stat]
    b = percentiles(_values([c[s] for s in seeds], metric))[stat]
    ratios = [r for _, _, r in per_seed.values()]
    sent = [sum(len(runs[s]["results"]) for s in seeds) for runs in (d, c)]
    completed = [sum(r["ok"] for s in seeds for r in runs[s]["results"]) for runs in (d, c)]
    return {"point": point, "metric": metric, "stat": stat, "per_seed": per_seed,
            "pooled": (a, b, a / b if b > 0 else math.nan), "spread": (min(ratios), max(ratios)),
            "requests": tuple(completed), "failed": (sent[0] - completed[0], sent[1] - completed[1]),
            "sent": tuple(sent),
            "throughput": {s: (d[s]["request_throughput"], c[s]["request_throughput"]) for s in seeds}}


def _verdict(r: dict[str, Any], bound: float) -> str:
    (fd, fc), (nd, nc) = r["failed"], r["sent"]
    if fd or fc:
        return (f"**{NO_VERDICT}: requests failed, disaggregated {fd} of {nd}, colocated {fc} of {nc}** "
                f"(<= {bound}x)")
    return ("met" if r["pooled"][2] <= bound else "not met") + f" (<= {bound}x)"


def _fmt(seconds: float, metric: str) -> str:
    return f"{seconds:.2f} s" if metric == "ttft" else f"{seconds * 1e3:.0f} ms"


def markdown(rows: list[tuple[str, float, dict[str, Any]]]) -> str:
    """(target name, bound, ratio_rows()) -> a table: one line per seed and one pooled,
    whose verdict is NO_VERDICT where a request failed. "(n / n req)": completed ones."""
    out = ["| target | load | metric | seed | disaggregated | colocated | ratio | req/s disagg / coloc | verdict |",
           "|---|---|---|---|---:|---:|---:|---:|---|"]
    for name, bound, r in rows:
        what = f"{r['metric'].upper()} {r['stat']}"
        for seed, (a, b, ratio) in r["per_seed"].items():
            ta, tb = r["throughput"][seed]
            out.append(f"| {name} | {r['point']} | {what} | {seed} | {_fmt(a, r['metric'])} | "
                       f"{_fmt(b, r['metric'])} | {ratio:.2f}x | {ta:.2f} / {tb:.2f} | |")
        a, b, ratio = r["pooled"]
        lo, hi = r["spread"]
        out.append(f"| {name} | {r['point']} | {what} | pooled ({r['requests'][0]} / {r['requests'][1]} req), "
                   f"seeds {lo:.2f}-{hi:.2f}x | {_fmt(a, r['metric'])} | {_fmt(b, r['metric'])} | "
                   f"**{ratio:.2f}x** | | {_verdict(r, bound)} |")
    return "\n".join(out)


def compare(disagg: dict[str, Any], coloc: dict[str, Any], p5_point: str | None = None,
            p6_point: str | None = None) -> str:
    """The P5 and P6 table; P5 at p5_point (default: the first common load point, which
    in a command of rising rates is the lowest), P6 at p6_point (default: the last).
    ValueError if the reports' commands differ or they share no load point."""
    check_same_command(disagg, coloc)
    points = common_points(disagg, coloc)
    if not points:
        raise ValueError("the two files share no load point run with the same seeds")
    for given in (p5_point, p6_point):
        if given is not None and given not in points:
            raise ValueError(f"load point {given!r} is not in both files; common ones: {points}")
    p5, p6 = p5_point or points[0], p6_point or points[-1]
    rows = [("P5", 1.15, ratio_rows(disagg, coloc, p5, "ttft", "p50")),
            ("P5", 1.15, ratio_rows(disagg, coloc, p5, "ttft", "p99")),
            ("P6", 0.5, ratio_rows(disagg, coloc, p6, "tpot", "p99"))]
    return markdown(rows)
