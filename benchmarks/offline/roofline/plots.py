"""PNG plots of the roofline report and of benchmarks/serving/serve.py's JSON. matplotlib is
imported inside each function: the GPU check imports this package on a machine that
has no matplotlib."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

DPI = 100


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    _pyplot().close(fig)
    return path


def plot_roofline(report: dict[str, Any], path: str | Path) -> Path:
    """Arithmetic intensity (FLOP/byte) against FLOP/s, log-log: the two roofs, and
    each measured step at its analytic intensity and its achieved FLOP/s."""
    plt = _pyplot()
    roof = report["roof"]
    bw, peak = roof["bytes_per_s"], roof["flops_per_s"]
    rows = report["rows"]
    intensities = [r["flops"] / r["bytes"] for r in rows]
    lo = min(intensities + [peak / bw]) / 4
    hi = max(intensities + [peak / bw]) * 4
    xs = [lo * (hi / lo) ** (k / 200) for k in range(201)]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.loglog(xs, [min(peak, x * bw) for x in xs], color="black", lw=1.5,
              label=f"roofs: {bw / 1e9:.1f} GB/s, {peak / 1e9:.0f} GFLOP/s")
    ax.axvline(peak / bw, color="grey", ls=":", lw=1)
    markers = {"decode": "o", "prefill": "s"}
    contexts = sorted({r["context"] for r in rows if r["kind"] == "decode"})
    for r, x in zip(rows, intensities):
        if r["measured_s"] is None:
            continue
        colour = f"C{contexts.index(r['context'])}" if r["kind"] == "decode" else "black"
        ax.scatter(x, r["flops"] / r["measured_s"], marker=markers[r["kind"]], color=colour, zorder=3)
        label = f"b{r['batch']}" if r["kind"] == "decode" else f"prefill {r['new_tokens']}"
        below = r["kind"] != "decode" or contexts.index(r["context"]) % 2 == 0  # neighbours' labels apart
        ax.annotate(label, (x, r["flops"] / r["measured_s"]), textcoords="offset points",
                    xytext=(4, -10) if below else (-18, 4), fontsize=7, color=colour)
    for i, c in enumerate(contexts):
        ax.scatter([], [], marker="o", color=f"C{i}", label=f"decode, context {c}")
    if any(r["kind"] == "prefill" for r in rows):
        ax.scatter([], [], marker="s", color="black", label="prefill step")
    ax.set_xlabel("arithmetic intensity (FLOP / byte)")
    ax.set_ylabel("FLOP/s attained")
    ax.set_title(f"Roofline: {Path(report['model']).name}, {report['dtype']} on {report['device']}", fontsize=10)
    ax.legend(fontsize=7, loc="lower right")
    ax.grid(True, which="both", alpha=0.3)
    return _save(fig, path)


def plot_step_times(report: dict[str, Any], path: str | Path) -> Path:
    """Decode step time against batch size, one line per context, measured (solid)
    beside its floor (dashed)."""
    plt = _pyplot()
    rows = [r for r in report["rows"] if r["kind"] == "decode"]
    if not rows:
        raise ValueError("the report has no decode rows to plot against batch size")
    fig, ax = plt.subplots(figsize=(7, 4.5))
    contexts = sorted({r["context"] for r in rows})
    for i, c in enumerate(contexts):
        line = sorted((r for r in rows if r["context"] == c), key=lambda r: r["batch"])
        colour = f"C{i}"
        batches = [r["batch"] for r in line]
        measured = [(r["batch"], r["measured_s"] * 1e3) for r in line if r["measured_s"] is not None]
        if measured:
            ax.plot(*zip(*measured), marker="o", color=colour, label=f"measured, context {c}")
        ax.plot(batches, [r["floor_s"] * 1e3 for r in line], ls="--", color=colour, label=f"floor, context {c}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    from matplotlib.ticker import FuncFormatter, NullFormatter

    plain = FuncFormatter(lambda v, _: f"{v:g}")  # 200, not 2 x 10^2
    ax.set_xticks(sorted({r["batch"] for r in rows}))
    ax.xaxis.set_major_formatter(plain)
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.yaxis.set_major_formatter(plain)
    ax.yaxis.set_minor_formatter(plain)
    ax.set_xlabel("batch size (sequences)")
    ax.set_ylabel("decode step time (ms)")
    ax.set_title(f"Decode step vs floor: {Path(report['model']).name}, {report['dtype']} on {report['device']}",
                 fontsize=10)
    ax.legend(fontsize=7)
    ax.grid(True, which="both", alpha=0.3)
    return _save(fig, path)


def serve_latencies(report: dict[str, Any], point: str | None = None) -> tuple[list[float], list[float]]:
    """(TTFT seconds, TPOT seconds) of every completed request, from benchmarks/serving/serve.py's
    --json report: over every run of its load point `point` (e.g. "rate 0.3/s",
    "concurrency 1"; every seed pooled), or of every run when None; TPOT only for
    requests of > 1 output token. Reads the "runs" list, else the older "rates" object."""
    from benchmarks.serving.compare import load_point

    if isinstance(report.get("runs"), list):
        runs = [(load_point(run), run) for run in report["runs"]]
    elif isinstance(report.get("rates"), dict):
        runs = [(f"rate {rate}/s", block) for rate, block in report["rates"].items()]
    else:
        raise ValueError("not a benchmarks/serving/serve.py --json report: it has no 'runs' list nor 'rates' object")
    if point is not None:
        runs = [(name, run) for name, run in runs if name == point]
        if not runs:
            raise ValueError(f"the serve report has no run at {point!r}")
    ttft, tpot = [], []
    for name, run in runs:
        if "results" not in run:
            raise ValueError(f"{name} of the serve report has no per-request 'results'")
        for r in run["results"]:
            if not r["ok"]:
                continue
            ttft.append(r["ttft"])
            if r["output_tokens"] > 1:
                tpot.append((r["e2e"] - r["ttft"]) / (r["output_tokens"] - 1))
    return ttft, tpot


def plot_serve_cdfs(reports: Sequence[dict[str, Any]], labels: Sequence[str], path: str | Path,
                    title: str = "", point: str | None = None) -> Path:
    """TTFT and TPOT CDFs, one line per serve report (its runs at load point `point`, or all)."""
    if len(reports) != len(labels):
        raise ValueError(f"{len(reports)} serve reports but {len(labels)} labels")
    plt = _pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.8))
    for report, label in zip(reports, labels):
        ttft, tpot = serve_latencies(report, point)
        for ax, values, scale in ((left, ttft, 1.0), (right, tpot, 1e3)):
            xs = sorted(v * scale for v in values)
            ax.step(xs, [(k + 1) / len(xs) for k in range(len(xs))], where="post", label=f"{label} (n={len(xs)})")
    left.set_xlabel("TTFT (s)")
    right.set_xlabel("TPOT (ms)")
    for ax in (left, right):
        ax.set_ylabel("fraction of requests")
        ax.set_ylim(0, 1.02)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    if title:
        fig.suptitle(title, fontsize=10)
    return _save(fig, path)
