"""Goodput under overload with SLO-aware admission (issue 41) against FCFS, per topology.

    .venv/bin/python -m benchmarks.serving slo --out results/slo.json           # the full run
    .venv/bin/python -m benchmarks.serving slo --quick --out results/slo-quick.json

Per topology (--topologies, CPU 1P1D and 1P2D from --config with remote prefill for
every prompt of --remote-min tokens or more), the fcfs arm's deployment first measures:
  capacity   completed req/s with --concurrency outstanding for --capacity-s (closed loop)
  unloaded   p50 TTFT and TPOT of --unloaded-requests sent one at a time
and from those the two SLO classes each request draws one of, half and half:
  interactive  slo_ttft_ms = --interactive-ttft x unloaded TTFT, slo_tpot_ms = --interactive-tpot x TPOT
  batch        --batch-ttft x, --batch-tpot x
Each arm is a deployment of its own (router.slo.policy: fcfs = off, slo = reject,
best_effort = best_effort); every request carries its SLO as body fields whatever the
arm. In each, every (--loads x capacity, --seeds) runs in turn: Poisson arrivals for
--duration s (the same trace per seed in every arm), then a drain and --idle-s idle.
A request is good if it completed within both of its targets as the client measured
them (TTFT: send to first streamed token; TPOT: (e2e - TTFT) / (tokens - 1)); a 429 or
a failure is not. goodput = good requests / --duration (the arrival window: one
denominator for every arm, so the ratio is that of good requests); throughput =
completed requests / the run's seconds (first arrival to last answer, a fcfs backlog's
drain included). The table gives medians over
seeds and goodput(arm) / goodput(fcfs); and the predictor's p50 |TTFT error| read from
/status right after each run, over that run's own requests (?prediction_window: the
predictions of its completed requests, the latest the router made). Every arm's
deployment goes through the same warm-up and measurement before
its runs (the same history for each); the fcfs arm's measurement sets the loads and
targets of all. --noisy (on by default): slo_noisy.py, --noisy-duration s per run.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
from pathlib import Path
from typing import Any

_REPO_ROOT = Path(__file__).resolve().parents[2]
if str(_REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(_REPO_ROOT))

from benchmarks.elastic.deployment import Deployment  # noqa: E402
from benchmarks.serving.load import Workload  # noqa: E402
from benchmarks.serving.report import json_text  # noqa: E402
from benchmarks.serving.server import server_model  # noqa: E402
from benchmarks.serving.slo_load import NO_SLO, SLOClass, Unloaded, draw_trace, run_open_loop, summarize  # noqa: E402
from benchmarks.serving.slo_noisy import TOPOLOGY as NOISY_TOPOLOGY  # noqa: E402
from benchmarks.serving.slo_noisy import run_noisy  # noqa: E402
from benchmarks.serving.slo_report import medians, noisy_rows, noisy_table, table  # noqa: E402
from benchmarks.serving.slo_setup import Live, arm_config, load_base, parse_topology, token_range  # noqa: E402

POLICIES = {"fcfs": "off", "slo": "reject", "best_effort": "best_effort"}
QUICK = {"topologies": "1p1d", "seeds": "0", "loads": "1,3", "duration": 10.0, "arms": "fcfs,slo",
         "capacity_s": 20.0, "warmup_s": 5.0, "unloaded_requests": 4, "idle_s": 2.0, "noisy_duration": 30.0}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", type=Path, default=_REPO_ROOT / "configs/local.yaml", help="base cluster config")
    p.add_argument("--topologies", default="1p1d,1p2d", help="'' for none (the noisy neighbour alone)")
    p.add_argument("--arms", default="fcfs,slo", help=f"of {','.join(POLICIES)}; fcfs is needed (the baseline)")
    p.add_argument("--loads", default="1,1.5,3", help="offered load, multiples of the measured capacity")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--duration", type=float, default=40.0, help="seconds of Poisson arrivals per run")
    p.add_argument("--capacity-s", type=float, default=30.0)
    p.add_argument("--concurrency", type=int, default=16, help="outstanding requests that saturate (capacity)")
    p.add_argument("--unloaded-requests", type=int, default=8)
    p.add_argument("--warmup-s", type=float, default=10.0)
    p.add_argument("--idle-s", type=float, default=3.0, help="idle seconds after each run's drain")
    p.add_argument("--prompt-tokens", default="100,300", help="MIN,MAX prompt length (token ids, exact)")
    p.add_argument("--output-tokens", default="8,32", help="MIN,MAX output length (ignore_eos)")
    p.add_argument("--remote-min", type=int, default=32, help="router.remote_prefill_min_tokens")
    for cls, ttft, tpot in (("interactive", 4.0, 3.0), ("batch", 20.0, 6.0)):
        p.add_argument(f"--{cls}-ttft", type=float, default=ttft, help="x unloaded p50 TTFT")
        p.add_argument(f"--{cls}-tpot", type=float, default=tpot, help="x unloaded p50 TPOT")
    p.add_argument("--noisy", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--quiet-load", type=float, default=0.25, help="the quiet key's rate, x capacity")
    p.add_argument("--noisy-factor", type=float, default=5.0, help="the noisy key's rate, x its share (capacity/2)")
    p.add_argument("--noisy-duration", type=float, default=90.0,
                   help="seconds of arrivals per noisy-neighbour run (longer than --duration: the quiet key's "
                        "rate is low, and its p99 needs requests)")
    p.add_argument("--noisy-class", choices=("batch", "interactive", "none"), default="batch")
    p.add_argument("--noisy-arms", default="fair,fcfs", help="of fair,fcfs: the noisy neighbour's deployments")
    p.add_argument("--noisy-prefill-tokens", type=int, default=None,
                   help="the prefill pool's max_num_batched_tokens in the noisy neighbour's deployments "
                        "(default: --config's): a prefill step in progress is not preempted, so it bounds "
                        "the quiet key's wait behind the flood")
    p.add_argument("--quick", action="store_true", help=f"a smoke run: {QUICK}")
    p.add_argument("--out", type=Path, help="the JSON report (written after every run)")
    p.add_argument("--log-dir", type=Path, help="deployments' configs and logs (default: a temporary directory)")
    if "--quick" in (sys.argv[1:] if argv is None else argv):
        p.set_defaults(**QUICK)  # explicit options still win
    args = p.parse_args(argv)
    try:
        args.topologies = [t for t in args.topologies.split(",") if t]  # none: the noisy neighbour alone
        for t in args.topologies:
            parse_topology(t)
        args.arms = args.arms.split(",")
        args.noisy_arms = args.noisy_arms.split(",")
        args.loads = [float(x) for x in args.loads.split(",")]
        args.seeds = [int(x) for x in args.seeds.split(",")]
        args.prompt_tokens = _pair(args.prompt_tokens)
        args.output_tokens = _pair(args.output_tokens)
    except ValueError as exc:
        p.error(str(exc))
    bad = [a for a in args.arms if a not in POLICIES]
    if bad:
        p.error(f"unknown arm {bad[0]!r}; choose from {', '.join(POLICIES)}")
    bad = [a for a in args.noisy_arms if a not in ("fair", "fcfs")]
    if bad:
        p.error(f"unknown noisy arm {bad[0]!r}; choose from fair, fcfs")
    if args.arms[0] != "fcfs":
        p.error("--arms must start with fcfs: its deployment measures the capacity every arm's loads scale")
    if args.output_tokens[0] < 2:
        p.error("--output-tokens must be >= 2 (TPOT needs two tokens)")
    return args


def _pair(text: str) -> tuple[int, int]:
    lo, hi = (int(x) for x in text.split(","))
    if not 0 < lo <= hi:
        raise ValueError(f"{text!r} is not MIN,MAX with 0 < MIN <= MAX")
    return lo, hi


def classes(args: argparse.Namespace, unloaded: Unloaded) -> list[SLOClass]:
    """The interactive and batch classes, in milliseconds, from the unloaded p50s."""
    return [SLOClass(name, round(getattr(args, f"{name}_ttft") * unloaded.ttft_s * 1000, 1),
                     round(getattr(args, f"{name}_tpot") * unloaded.tpot_s * 1000, 1))
            for name in ("interactive", "batch")]


def measure(args: argparse.Namespace, live: Live, label: str) -> dict[str, Any]:
    capacity = live.capacity(args.concurrency, args.capacity_s)
    unloaded = live.unloaded(args.unloaded_requests)
    mix = classes(args, unloaded)
    print(f"{label}: capacity {capacity:.2f} req/s; unloaded p50 TTFT {unloaded.ttft_s * 1000:.0f} ms, "
          f"TPOT {unloaded.tpot_s * 1000:.1f} ms; targets: "
          + ", ".join(f"{c.name} ttft {c.ttft_ms:g} ms / tpot {c.tpot_ms:g} ms" for c in mix), flush=True)
    return {"capacity": capacity, "unloaded": {"ttft_s": unloaded.ttft_s, "tpot_s": unloaded.tpot_s},
            "classes": [vars(c) for c in mix]}


def run_arm(args: argparse.Namespace, base: dict, workload: Workload, topology: str, arm: str,
            measured: dict[str, Any], report: dict[str, Any], log_dir: Path) -> None:
    """One arm's deployment: (fcfs) the measurement, then every (load, seed) in turn."""
    config = arm_config(base, topology, POLICIES[arm], args.remote_min)
    with Deployment(config, log_dir / f"{topology}-{arm}") as d:
        live = Live(d, server_model(d.url), workload)
        live.warm_up(args.concurrency, args.warmup_s)
        # Every arm runs the same measurement, so each deployment (the slo arm's predictor
        # too) has the same history before its first run; only the first arm's (fcfs) is used.
        mine = measure(args, live, f"{topology} {arm}")
        measured.setdefault(topology, mine)
        report["per_arm"].append({"topology": topology, "arm": arm, **mine})
        save(args, report)
        capacity = measured[topology]["capacity"]
        mix = [SLOClass(**c) for c in measured[topology]["classes"]]
        live.drain(args.idle_s)
        for load in args.loads:
            for seed in args.seeds:
                trace = draw_trace(workload, seed, load * capacity, args.duration, mix)
                elapsed = asyncio.run(run_open_loop(d.url, live.model, trace))
                figures = summarize(trace, elapsed, args.duration)
                # The run's own predictions: each completed request's is among the latest.
                window = live.status(figures["completed"])["slo"]["prediction_error"] if figures["completed"] else None
                run = {"topology": topology, "arm": arm, "load": load, "seed": seed, "rate": load * capacity,
                       **figures, "prediction_error": window}
                report["runs"].append(run)
                print(f"  {topology} {arm:11} {load:g}x seed {seed}: goodput {run['goodput']:.2f} req/s "
                      f"({run['good']}/{run['requests']} good, {run['rejected']} rejected, {run['failed']} failed), "
                      f"throughput {run['throughput']:.2f} req/s, {elapsed:.0f} s", flush=True)
                save(args, report)
                live.drain(args.idle_s)


def measure_only(args: argparse.Namespace, base: dict, workload: Workload, topology: str,
                 measured: dict[str, Any], log_dir: Path) -> None:
    """Capacity and targets for a topology no arm ran (the noisy neighbour's 1P1D)."""
    with Deployment(arm_config(base, topology, "off", args.remote_min), log_dir / f"{topology}-measure") as d:
        live = Live(d, server_model(d.url), workload)
        live.warm_up(args.concurrency, args.warmup_s)
        measured[topology] = measure(args, live, topology)


def save(args: argparse.Namespace, report: dict[str, Any]) -> None:
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json_text(report))


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    base = load_base(args.config)
    workload = Workload(output_len=args.output_tokens, prompt_tokens=args.prompt_tokens, token_ids=token_range(base))
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="slo-bench-"))
    print(f"logs: {log_dir}", flush=True)
    measured: dict[str, Any] = {}
    report: dict[str, Any] = {"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                              "topologies": measured, "per_arm": [], "runs": [], "noisy": []}
    for topology in args.topologies:
        for arm in args.arms:
            run_arm(args, base, workload, topology, arm, measured, report, log_dir)
    if args.noisy:
        if NOISY_TOPOLOGY not in measured:
            measure_only(args, base, workload, NOISY_TOPOLOGY, measured, log_dir)
        interactive, batch = (SLOClass(**c) for c in measured[NOISY_TOPOLOGY]["classes"])
        noisy_slo = {"batch": batch, "interactive": interactive, "none": NO_SLO}[args.noisy_class]
        report["noisy"] = run_noisy(args, base, workload, measured[NOISY_TOPOLOGY]["capacity"], interactive,
                                    noisy_slo, log_dir)
    report["table"] = medians(report["runs"])
    print("\n" + table(report["table"]))
    if report["noisy"]:
        report["noisy_table"] = noisy_rows(report["noisy"])
        print("\nnoisy neighbour (1p1d; quiet key's p99 TTFT; target: fair + noisy / alone <= 1.5)\n"
              + noisy_table(report["noisy_table"]))
    save(args, report)
    if args.out is not None:
        print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
