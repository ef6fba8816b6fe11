"""What a chaos run measured, and whether it met its targets (benchmarks/chaos/run.py).

Definitions (docs/benchmarks/2026-12-02-chaos-soak.md says the same):
- A request is *lost* when it did not complete (any cause but `ok`, and `dropped`,
  which the client chose; for a flood request also `http_429`, the shedding the flood
  is there to cause) unless, at some moment of its life, every decode worker was down:
  each under a fault of the run's (from its SIGKILL or SIGSTOP until the router sees
  it live again). A worker the router takes for dead while it runs excuses nothing,
  nor does a prefill outage: decode workers prefill locally meanwhile, by design.
- A *leaked block* is a KV block not free on a worker once the load has stopped, every
  request has ended and every worker is live and idle. Free counts evictable
  prefix-cache blocks (engine/kv_cache/block_pool.py), so the target is 0.
- *Bad input* is the fuzz corpus; a 5xx answer to any case misses the target.
- *Memory flat*: the resident memory of the router, and of each worker process that
  lived through the whole load after warm-up, grows by at most the tolerance from the
  median of the first tenth of that span to the median of the last tenth. Resident
  memory here is VmRSS less RssShmem: a decode worker's KV cache is shared memory
  (shm transport), resident once each block is first written, so it grows to the
  pool's size as the blocks are used, which is no leak. Both are reported.
- A forged worker message is *acted on* when anything comes back to the forger.
"""

from __future__ import annotations

import statistics
from collections import Counter, defaultdict
from typing import Any

from benchmarks.chaos.attacks import Forgery
from benchmarks.chaos.faults import Fault
from benchmarks.chaos.load import Outcome

NOT_LOST = {"load": {"ok", "dropped"}, "flood": {"ok", "http_429"}}


def decode_down_spans(faults: list[Fault], decode: list[str], end: float) -> list[tuple[float, float]]:
    """The spans during which every decode worker was down by the run's own hand (a
    signal sent, and the router not yet seeing it live again). The router's view alone
    excuses nothing: a live worker it wrongly took for dead is a bug to catch."""
    spans = [(f.start, f.end or end) for f in faults if f.pid]
    moments = sorted({t for span in spans for t in span})
    down = []
    for a, b in zip(moments, moments[1:]):
        hit = {f.worker for f in faults if f.pid and f.start <= a and b <= (f.end or end)}
        if set(decode) <= hit:
            down.append((a, b))
    return down


def _overlaps(o: Outcome, spans: list[tuple]) -> bool:
    return any(o.start <= b and a <= o.end for a, b in spans)


def requests_summary(outcomes: list[Outcome], down: list[tuple]) -> dict[str, Any]:
    out = {}
    for kind in ("load", "flood", "fuzz"):
        mine = [o for o in outcomes if o.kind == kind]
        causes = Counter(o.cause for o in mine)
        failed = {c: n for c, n in causes.items() if c not in ("ok", "dropped")}
        row: dict[str, Any] = {"sent": len(mine), "completed": causes["ok"], "dropped_by_client": causes["dropped"],
                               "failed": dict(sorted(failed.items())),
                               "streams": sum(o.stream for o in mine),
                               "streams_broken": causes["broken_stream"],
                               "retried_429": sum(o.attempts > 1 for o in mine)}
        if kind in NOT_LOST:
            bad = [o for o in mine if o.cause not in NOT_LOST[kind]]
            lost = [o for o in bad if not _overlaps(o, down)]
            row |= {"lost": len(lost), "excused_all_decode_down": len(bad) - len(lost),
                    "lost_examples": [o.to_json() for o in lost[:5]]}
        out[kind] = row
    return out


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


def latency(outcomes: list[Outcome], faults: list[Fault], end: float) -> dict[str, Any]:
    """End-to-end seconds of completed load requests, those overlapping a process fault
    (from the signal until the worker is live again) apart from the others."""
    spans = [(f.start, f.end or end) for f in faults if f.pid]
    groups: dict[str, list[float]] = defaultdict(list)
    for o in outcomes:
        if o.kind == "load" and o.cause == "ok":
            groups["faults" if _overlaps(o, spans) else "calm"].append(o.end - o.start)
    return {k: {"n": len(groups[k]), "p50_s": _percentile(groups[k], 0.5), "p99_s": _percentile(groups[k], 0.99)}
            for k in ("calm", "faults")}


def rss_summary(rss: list[tuple[float, str, int, int, int]], t0: float, t1: float,
                warmup_s: float) -> dict[str, Any]:
    """Per process (name:pid): its memory (MiB, VmRSS less RssShmem) at the start and
    end of the measured span [t0 + warmup_s, t1], its growth, its VmRSS, and whether it
    lived through that span."""
    by_proc: dict[tuple[str, int], list[tuple[float, int, int]]] = defaultdict(list)
    for t, name, pid, vmrss, own in rss:
        by_proc[(name, pid)].append((t, vmrss, own))
    lo = t0 + warmup_s
    out = {}
    for (name, pid), points in sorted(by_proc.items()):
        span = [p for p in points if p[0] >= lo]
        if len(span) < 2:
            continue
        tenth = max(1, len(span) // 10)
        first, last = (statistics.median(p[2] for p in part) / 1024 for part in (span[:tenth], span[-tenth:]))
        vm_first, vm_last = (statistics.median(p[1] for p in part) / 1024 for part in (span[:tenth], span[-tenth:]))
        out[f"{name}:{pid}"] = {"name": name, "pid": pid, "first_mib": round(first, 1), "last_mib": round(last, 1),
                                "max_mib": round(max(p[2] for p in span) / 1024, 1), "growth": round(last / first - 1, 4),
                                "vmrss_first_mib": round(vm_first, 1), "vmrss_last_mib": round(vm_last, 1),
                                "whole_span": points[0][0] <= lo + 5 and points[-1][0] >= t1 - 5}
    return out


def targets(requests: dict, leaked: dict[str, int | None], fuzz: list[Outcome], down: list[tuple[float, float]],
            rss: dict, forged: list[Forgery], rss_tolerance: float, drained: bool) -> list[dict[str, Any]]:
    """Each target: met or not, and what was measured. A 503 to bad input while every
    decode worker was down is excused as a lost request is (the body may be judged only
    by a decode worker, e.g. a grammar)."""
    lost = requests["load"]["lost"] + requests["flood"]["lost"]
    fives = [f"{o.name}: {o.status}" for o in fuzz if o.status is not None and o.status >= 500
             and not (o.status == 503 and _overlaps(o, down))]
    leaks = {w: n for w, n in leaked.items() if n != 0}
    checked = {k: v for k, v in rss.items() if v["whole_span"]}
    grew = {k: v["growth"] for k, v in checked.items() if v["growth"] > rss_tolerance}
    acted = [f"{f.worker} {f.message}: {f.replies}" for f in forged if f.acted_on]
    return [
        {"target": "no request lost (but while every decode worker is down)", "ok": lost == 0,
         "measured": f"{lost} lost"},
        {"target": "0 leaked KV blocks after the drain", "ok": drained and not leaks,
         "measured": f"{leaks or 'none'}" + ("" if drained else "; workers not idle and live at the end")},
        {"target": "0 5xx answers to bad input", "ok": not fives and bool(fuzz),
         "measured": f"{len(fives)} of {len(fuzz)}" + (f": {fives}" if fives else "")},
        {"target": f"memory flat (within {rss_tolerance:.0%} after warm-up)", "ok": bool(checked) and not grew,
         "measured": ", ".join(f"{k} {v['growth']:+.1%}" for k, v in checked.items()) or "no process lived through"},
        {"target": "no unauthenticated worker message acted on", "ok": not acted and bool(forged),
         "measured": f"{len(acted)} of {len(forged)} acted on" + (f": {acted}" if acted else "")},
    ]


def table(report: dict[str, Any]) -> str:
    """The report as text, for the terminal."""
    lines = [f"chaos run: {report['load_seconds']:.0f} s of load, seed {report['seed']}, {report['config']}", ""]
    lines.append(f"{'':8} {'sent':>5} {'done':>5} {'dropped':>7} {'lost':>5} {'streams':>7} {'broken':>6}  failed by cause")
    for kind, r in report["requests"].items():
        lines.append(f"{kind:8} {r['sent']:5} {r['completed']:5} {r['dropped_by_client']:7} {r.get('lost', '-'):>5} "
                     f"{r['streams']:7} {r['streams_broken']:6}  {r['failed'] or '-'}")
    faults = Counter(f"{f['action']} {f['worker']}" for f in report["faults"] if f["pid"])
    lines += ["", "faults: " + ", ".join(f"{k} x{n}" for k, n in sorted(faults.items()))]
    for k, v in report["latency"].items():
        p50, p99 = (f"{v[q]:.2f} s" if v[q] is not None else "-" for q in ("p50_s", "p99_s"))
        lines.append(f"latency {k:6}: n={v['n']:4}  p50 {p50}  p99 {p99}")
    lines.append("leaked blocks: " + ", ".join(f"{w} {n}" for w, n in report["leaked_blocks"].items()))
    lines.append("memory (MiB less shared; after warm-up, first -> last): " + ", ".join(
        f"{k} {v['first_mib']:.0f}->{v['last_mib']:.0f}{'' if v['whole_span'] else ' (partial)'}"
        for k, v in report["rss"].items()))
    lines += ["", "targets:"]
    lines += [f"  [{'PASS' if t['ok'] else 'FAIL'}] {t['target']}: {t['measured']}" for t in report["targets"]]
    return "\n".join(lines)
