"""One arm's run summarized (goodput under the SLOs, DistServe's definition: requests/s
that met both the TTFT and the TPOT SLO; worker-seconds from the pool samples), the
arms' medians over repeats, and the markdown table docs/benchmarks/2026-12-02-elastic-pools.md shows."""

from __future__ import annotations

import statistics
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from benchmarks.elastic.trace import Trace
from benchmarks.elastic.watch import Sample, integrate, timeline
from benchmarks.serving.report import number, summarize

# What the table shows of each arm: its runs' median of each.
COLUMNS = ("goodput", "within_slo", "ttft_p90", "tpot_p90", "worker_s", "process_s", "max_workers",
           "scale_events", "failed")


def counter_total(metrics: str | None, name: str) -> dict[str, float]:
    """A counter's values in a /metrics text by its labels ("action=add,role=decode")."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(metrics or ""):
        if family.name != name:
            continue
        for sample in family.samples:
            if sample.name == f"{name}_total":
                out[",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))] = sample.value
    return out


def summarize_run(trace: Trace, window_s: float, slo: tuple[float, float], samples: list[Sample],
                  metrics: str | None) -> dict[str, Any]:
    """The run over its window (the trace's start to its end or the last answer, the later):
    the requests' latencies and goodput, the same per phase, and the workers it used."""
    results = [r for _, _, r in trace.schedule]
    s = summarize(results, window_s, *slo)
    good = round(s["goodput"] * window_s)
    phases = {}
    for phase in trace.phases:
        mine = [r for r, name in zip(results, trace.phase_of) if name == phase.name]
        p = summarize(mine, phase.seconds, *slo)
        phases[phase.name] = {"requests": p["requests"], "failed": p["failed"],
                              "within_slo": round(p["goodput"] * phase.seconds) / p["requests"] if mine else None,
                              "ttft_p90": p["ttft"]["p90"], "tpot_p90": p["tpot"]["p90"]}
    return {
        "requests": s["requests"], "failed": s["failed"], "errors": s["errors"], "window_s": window_s,
        "goodput": s["goodput"], "within_slo": good / s["requests"] if s["requests"] else float("nan"),
        "ttft_p90": s["ttft"]["p90"], "tpot_p90": s["tpot"]["p90"], "ttft": s["ttft"], "tpot": s["tpot"],
        "worker_s": integrate(samples, 0.0, window_s, "workers"),
        "process_s": integrate(samples, 0.0, window_s, "processes"),
        "max_workers": max((max(x.workers, x.processes) for x in samples), default=0),
        "scale_events": sum(counter_total(metrics, "pdserve_scale_events").values()),
        "scale_events_by_kind": counter_total(metrics, "pdserve_scale_events"),
        "autoscale_decisions": counter_total(metrics, "pdserve_autoscale_decisions"),
        "phases": phases, "pools": timeline(samples),
        # Every request, to judge other SLOs by: [phase, arrival s, TTFT s, TPOT s, ok]
        "by_request": [[name, round(t, 3), round(r.ttft, 4), None if r.tpot is None else round(r.tpot, 5), r.ok]
                       for (t, _, r), name in zip(trace.schedule, trace.phase_of)],
    }


def medians(runs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """arm -> the median over its runs of each column (NaN where no run has a value), and how many runs."""
    out: dict[str, dict[str, Any]] = {}
    for arm in dict.fromkeys(r["arm"] for r in runs):
        mine = [r for r in runs if r["arm"] == arm]
        row: dict[str, Any] = {"runs": len(mine)}
        for col in COLUMNS:
            values = [r[col] for r in mine if r.get(col) is not None and r[col] == r[col]]
            row[col] = statistics.median(values) if values else float("nan")
        out[arm] = row
    return out


def table(runs: list[dict[str, Any]]) -> str:
    """The arms' medians as a markdown table."""
    lines = ["| arm | runs | goodput (req/s) | within SLO | p90 TTFT | p90 TPOT | worker-s (pools / processes) "
             "| max workers | scale events | failed |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for arm, m in medians(runs).items():
        lines.append(f"| {arm} | {m['runs']} | {number(m['goodput'], 1, 3)} | {number(m['within_slo'], 100, 0)}% "
                     f"| {number(m['ttft_p90'], 1, 2)} s | {number(m['tpot_p90'], 1e3, 0)} ms "
                     f"| {number(m['worker_s'], 1, 0)} / {number(m['process_s'], 1, 0)} "
                     f"| {number(m['max_workers'], 1, 0)} | {number(m['scale_events'], 1, 1)} "
                     f"| {number(m['failed'], 1, 0)} |")
    return "\n".join(lines)


def run_line(run: dict[str, Any]) -> str:
    cpu = run["cpu"]
    phases = "; ".join(f"{name} {number(p['within_slo'], 100, 0)}% of {p['requests']}"
                       for name, p in run["phases"].items())
    return (f"{run['arm']} #{run['repeat']}: goodput {run['goodput']:.3f} req/s, "
            f"{number(run['within_slo'], 100, 0)}% within SLO ({phases}), "
            f"p90 TTFT {number(run['ttft_p90'], 1, 2)} s, p90 TPOT {number(run['tpot_p90'], 1e3, 0)} ms, "
            f"{run['worker_s']:.0f} worker-s ({run['process_s']:.0f} process-s), {run['scale_events']:.0f} scale events, "
            f"{run['failed']} failed; CPU cores: deployment {cpu['deployment_s'] / cpu['window_s']:.2f}, "
            f"others {cpu['others_s'] / cpu['window_s']:.2f} of {cpu['cpus']}"
            + (f" {run['errors']}" if run["errors"] else ""))

