"""Elastic pools under a three-phase trace (issue 22): fixed pools against pools scaled
at runtime, by goodput under the SLOs and by the worker-seconds they used.

    # the doc run: both fixed arms, the scripted reference and the planner, 3 times each (~16 min on 2 cores)
    .venv/bin/python -m benchmarks.elastic autoscale --arms 1p1d,1p2d,scripted,autoscaled --repeats 3 \
        --max-minutes 20 --json docs/data/autoscale-bench.json
    # the planner's arm alone, added to that JSON (same trace and SLOs; its runs replaced if there; ~4 min)
    .venv/bin/python -m benchmarks.elastic autoscale --arms autoscaled --repeats 3 --append --json docs/data/autoscale-bench.json
    # the SLO defaults: an unloaded 1P1D's p90 TTFT and TPOT on the trace's requests, times --slo-factor
    .venv/bin/python -m benchmarks.elastic autoscale --calibrate

The trace (benchmarks/elastic/trace.py): --phase-s seconds each of prefill-heavy (prompts
of 400-800 token ids, 4-8 output tokens), decode-heavy (16-48, 64-128 out) and idle
(a request now and then), rate x --phase-s requests each at Poisson arrival times drawn
from --seed (+ the repeat's index), so every arm sees the same requests at the same
times; --scale multiplies the rates. Each
request is streamed (TTFT, TPOT as benchmarks/serving/serve.py defines them); goodput is the
requests/s that met both SLOs (DistServe's definition), over the run's window: the
trace's start to its end or the last answer, whichever is later.

Arms (--arms), each deployed by `pdserve serve` from --config with its pools set, one at
a time, every process of one stopped before the next starts:
  NpMd        fixed: N prefill + M decode workers
  scripted    the pools set through /admin/scale at each phase's start to --script's shape
              for that phase: an oracle schedule, a reference for what a planner could reach
  autoscaled  the config's autoscale section on (the planner's SLO targets are the SLOs
              here, autoscale.max_workers --max-workers, the pools' bounds AUTOSCALE's, its
              timescales short for a short trace; --autoscale FILE overrides keys),
              starting at 1P1D
No arm has more than --max-workers workers taking work at once (a warning says if one
did). Worker-seconds are
measured: the router's /admin/pools every 0.5 s (every worker it lists, draining ones
included), and the worker processes alive (those still loading included). Every run also
records the CPU time its deployment and the rest of the machine took (a shared machine
makes every arm collapse). Runs go arm by arm within a repeat; the table shows each
arm's medians over --repeats.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import math
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# Run as a file, this script's folder heads sys.path, where a module could shadow a
# package or the standard library (elastic/trace.py: `trace`): the repo root goes first.
_REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
if str(_REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(_REPO_ROOT))

import yaml  # noqa: E402

from benchmarks.elastic.arms import Arm, ScriptedScaler, Shape, parse_arms  # noqa: E402
from benchmarks.elastic.deployment import Deployment, DeploymentError  # noqa: E402
from benchmarks.elastic.report import medians, run_line, summarize_run, table  # noqa: E402
from benchmarks.elastic.trace import Phase, Trace, draw_trace, model_token_ids, three_phases  # noqa: E402
from benchmarks.elastic.watch import PoolWatcher  # noqa: E402
from benchmarks.serving.load import run_concurrency, run_poisson  # noqa: E402
from benchmarks.serving.report import json_text, percentiles  # noqa: E402
from benchmarks.serving.server import server_model  # noqa: E402

# From `--calibrate` on the 2-core machine (docs/benchmarks/2026-12-02-elastic-pools.md): 3x an
# unloaded 1P1D's p90 TTFT of the prefill-heavy requests and p90 TPOT of the decode-heavy ones.
SLO_TTFT_S = 6.0
SLO_TPOT_S = 0.073
# The autoscaled arm's section: timescales short enough to act within a phase of tens of
# seconds (the defaults are sized for minutes); max_workers and the SLO targets filled in
# from the arguments. One prefill worker at most: on 2 cores a second only shares the
# cores the decode worker idles on in a prefill-heavy phase, which the planner reaches
# instead by moving remote_prefill_min_tokens (prompts to the decode worker). Prefill
# jobs above 2 per worker queue: a step of max_num_batched_tokens 512 takes one prompt of
# 400-800 tokens.
AUTOSCALE = {"enabled": True, "interval_s": 1.0, "window_s": 4.0, "scale_up_cooldown_s": 4.0,
             "scale_down_cooldown_s": 4.0, "drain_timeout_s": 5.0, "prefill_jobs_high": 2.0,
             "prefill": {"min": 0, "max": 1}}
# Setting up and stopping an arm's deployment, on top of its trace (for the time check).
ARM_OVERHEAD_S = 30.0
# Arguments that must be equal for --append to add runs to a report.
SAME_TRACE = ("phase_s", "scale", "seed", "slo_ttft", "slo_tpot", "max_workers", "model")


def autoscale_section(args: argparse.Namespace) -> dict[str, Any]:
    """The autoscaled arm's `autoscale:` section: the built-in one, the SLOs as the
    planner's targets, bounds within --max-workers (both pools together too), then
    --autoscale's keys over it."""
    decode_max = max(1, args.max_workers - 1)
    section: dict[str, Any] = {"decode": {"min": 1, "max": decode_max}, **AUTOSCALE, "ttft_p90_s": args.slo_ttft,
                               "tpot_p90_s": args.slo_tpot, "max_workers": args.max_workers}
    if args.autoscale:
        extra = yaml.safe_load(Path(args.autoscale).read_text()) or {}
        if not isinstance(extra, dict):
            raise ValueError(f"--autoscale {args.autoscale}: must hold a mapping (the autoscale section's keys)")
        section.update(extra)
    return section


def check_config(arm: Arm, base: dict[str, Any]) -> None:
    """The arm's config, validated here before any process starts (a ConfigError names
    its YAML path); for the autoscaled arm, a tree without the planner says so."""
    from cluster.config import ClusterConfig

    try:
        ClusterConfig.from_dict(arm.config(base))
    except ValueError as exc:
        if arm.autoscale is not None and str(exc).startswith("autoscale: unknown key"):
            raise ValueError("the autoscaled arm needs the planner's `autoscale:` config section "
                             "(cluster/autoscale/), which this tree does not have yet") from None
        raise ValueError(f"arm {arm.name}: {exc}") from None


def play(arm: Arm, trace: Trace, base: dict[str, Any], slo: tuple[float, float], max_workers: int,
         log_dir: Path) -> dict[str, Any]:
    """One run of the trace against a fresh deployment of the arm, stopped before returning."""
    load_before = os.getloadavg()
    with Deployment(arm.config(base), log_dir) as deployment:
        model = server_model(deployment.url)
        t0 = time.perf_counter()
        watcher = PoolWatcher(deployment, t0)
        watcher.start()
        scaler = ScriptedScaler(deployment, arm.script, trace.starts(), t0) if arm.script else None
        if scaler is not None:
            scaler.start()
        try:
            asyncio.run(run_poisson(deployment.url, model, trace.schedule, f"{arm.name} seed {trace.seed}"))
            time.sleep(max(0.0, t0 + trace.seconds - time.perf_counter()))  # the idle tail counts too
            window = time.perf_counter() - t0
        finally:
            if scaler is not None:
                scaler.stop()
            watcher.stop()
        cpu = watcher.cpu.totals() | {"window_s": window}
        metrics = deployment.metrics()
    run = {"arm": arm.name, "seed": trace.seed, "loadavg_before": load_before, "loadavg_after": os.getloadavg(),
           "cpu": cpu,
           **summarize_run(trace, window, slo, watcher.samples, metrics)}
    if scaler is not None:
        run["scale_calls"] = scaler.calls
    if watcher.errors:
        run["sample_errors"] = watcher.errors[:10]
    if run["max_workers"] > max_workers:  # autoscale.max_workers bounds the planner; a warning if it did not
        print(f"warning: {arm.name} ran {run['max_workers']} workers at once, beyond --max-workers {max_workers}",
              file=sys.stderr)
    if arm.autoscale is not None and not run["autoscale_decisions"] and not run["scale_events"]:
        print(f"warning: the autoscaled arm's planner decided nothing (no pdserve_autoscale_decisions, no scale "
              f"events): is it running in this deployment? (log: {deployment.log_path})", file=sys.stderr)
    return run


def calibrate(phases: list[Phase], base: dict[str, Any], token_ids: tuple[int, int], seed: int, factor: float,
              log_dir: Path) -> dict[str, float]:
    """An unloaded 1P1D (one request at a time): p90 TTFT of 6 prefill-heavy requests, p90
    TPOT of 3 decode-heavy ones, and the SLOs they suggest (factor times each)."""
    trace = draw_trace(phases, seed, token_ids)
    by_phase = {p.name: [(0.0, prompt, r) for (_, prompt, r), name in zip(trace.schedule, trace.phase_of)
                         if name == p.name] for p in phases}
    long, decode = by_phase["prefill-heavy"][:6], by_phase["decode-heavy"][:3]
    with Deployment(Arm("1p1d", Shape(1, 1)).config(base), log_dir) as deployment:
        model = server_model(deployment.url)
        for label, requests in (("calibrate prefill-heavy", long), ("calibrate decode-heavy", decode)):
            asyncio.run(run_concurrency(deployment.url, model, requests, 1, label))
    failed = [r.error for _, _, r in long + decode if not r.ok]
    if failed:
        raise DeploymentError(f"calibration requests failed: {failed[:3]}")
    ttft = percentiles([r.ttft for _, _, r in long])
    tpot = percentiles([r.tpot for _, _, r in decode if r.tpot is not None])
    return {"ttft_p50": ttft["p50"], "ttft_p90": ttft["p90"], "tpot_p50": tpot["p50"], "tpot_p90": tpot["p90"],
            "slo_ttft": factor * ttft["p90"], "slo_tpot": factor * tpot["p90"]}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="autoscale.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="configs/local.yaml", help="the cluster config every arm starts from")
    p.add_argument("--arms", default="1p1d,1p2d,scripted", help="comma-separated: NpMd, scripted, autoscaled")
    p.add_argument("--script", default="2p1d,0p2d,0p1d", help="scripted: each phase's shape")
    p.add_argument("--max-workers", type=int, default=3, help="the most workers any arm may have at once")
    p.add_argument("--phase-s", type=float, default=20.0, help="seconds of each phase")
    p.add_argument("--scale", type=float, default=1.0, help="multiplies every phase's request rate")
    p.add_argument("--seed", type=int, default=0, help="repeat i plays the trace of seed + i")
    p.add_argument("--repeats", type=int, default=2, help="runs of each arm (the table shows their medians)")
    p.add_argument("--slo-ttft", type=float, default=SLO_TTFT_S, help="seconds (default: from --calibrate)")
    p.add_argument("--slo-tpot", type=float, default=SLO_TPOT_S, help="seconds per output token")
    p.add_argument("--slo-factor", type=float, default=3.0, help="--calibrate: the SLOs as this times the p90s")
    p.add_argument("--worker-timeout-s", type=float, default=30.0,
                   help="router.worker_timeout_s of every arm, unless --config sets it (see below)")
    p.add_argument("--autoscale", default=None, help="a YAML file of autoscale-section keys over the built-in ones")
    p.add_argument("--json", dest="json_path", default=None, help="write the report here")
    p.add_argument("--append", action="store_true",
                   help="add these arms' runs to the report at --json (same trace and SLOs), replacing theirs")
    p.add_argument("--calibrate", action="store_true", help="measure the SLO defaults instead")
    p.add_argument("--log-dir", default=None, help="the deployments' configs and logs (default: a temporary dir)")
    p.add_argument("--max-minutes", type=float, default=12.0, help="refuse a command expected to run longer")
    args = p.parse_args(argv)
    for option, value in (("--slo-ttft", args.slo_ttft), ("--slo-tpot", args.slo_tpot),
                          ("--slo-factor", args.slo_factor), ("--max-minutes", args.max_minutes)):
        if not (math.isfinite(value) and value > 0):
            p.error(f"{option} must be a number > 0, got {value}")
    if args.repeats < 1:
        p.error(f"--repeats must be >= 1, got {args.repeats}")
    if args.max_workers < 2:
        p.error(f"--max-workers must be >= 2 (a prefill and a decode worker), got {args.max_workers}")
    if args.append and not args.json_path:
        p.error("--append needs --json (the report to add to)")
    try:
        base = yaml.safe_load(Path(args.config).read_text())
        if not isinstance(base, dict):
            raise ValueError("not a mapping")
    except (OSError, ValueError, yaml.YAMLError) as exc:
        p.error(f"--config {args.config}: {exc}")
    model = Path(base.get("model", ""))
    if not model.is_absolute() and (Path.cwd() / model).exists():  # pdserve serve runs from the repo root
        base["model"] = str((Path.cwd() / model).resolve())
    # The default 10 s must exceed the longest engine step; on 2 cores shared with other
    # work a step of a 512-token chunk took longer, the worker was declared dead, and the
    # failover's recomputation of its requests snowballed.
    base["router"] = {"worker_timeout_s": args.worker_timeout_s, **(base.get("router") or {})}
    args.base, args.model = base, str(base["model"])
    try:
        args.phases = three_phases(args.phase_s, args.scale)
        args.token_ids = model_token_ids(args.model)
        args.arm_list = [] if args.calibrate else parse_arms(args.arms, args.script, len(args.phases),
                                                             args.max_workers, autoscale_section(args))
        for arm in args.arm_list:
            check_config(arm, base)
    except (OSError, ValueError) as exc:
        p.error(str(exc))
    expected = len(args.arm_list) * args.repeats * (sum(ph.seconds for ph in args.phases) + ARM_OVERHEAD_S)
    if expected > args.max_minutes * 60:
        p.error(f"{len(args.arm_list)} arms x {args.repeats} repeats of a {sum(ph.seconds for ph in args.phases):g} "
                f"s trace take about {expected / 60:.1f} min, beyond --max-minutes {args.max_minutes:g}")
    return args


def report_for(args: argparse.Namespace, runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The JSON report: how it was run, the trace, and every run (added to --json's with --append)."""
    report = earlier_report(args) or {
        "benchmark": "autoscale", "args": same_trace(args), "config": args.config, "script": args.script,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "trace": draw_trace(args.phases, args.seed, args.token_ids).describe(), "runs": []}
    mine = {arm.name for arm in args.arm_list}
    report["runs"] = [r for r in report["runs"] if r["arm"] not in mine] + runs
    report.setdefault("commands", []).append(" ".join(sys.argv))
    report["medians"] = medians(report["runs"])
    return report


def same_trace(args: argparse.Namespace) -> dict[str, Any]:
    return {"phase_s": args.phase_s, "scale": args.scale, "seed": args.seed, "slo_ttft": args.slo_ttft,
            "slo_tpot": args.slo_tpot, "max_workers": args.max_workers, "model": args.model}


def earlier_report(args: argparse.Namespace) -> dict[str, Any] | None:
    """With --append, the report at --json (None if there is none yet); ValueError if it
    was run with another trace or other SLOs, whose runs these cannot join."""
    if not args.append or not Path(args.json_path).exists():
        return None
    report = json.loads(Path(args.json_path).read_text())
    theirs, ours = report.get("args", {}), same_trace(args)
    differ = [f"{k} {theirs.get(k)!r}" for k in SAME_TRACE if theirs.get(k) != ours[k]]
    if differ:
        raise ValueError(f"--append: {args.json_path} was run with {', '.join(differ)}: rerun with those")
    return report


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="autoscale-bench-"))
    if args.calibrate:
        got = calibrate(args.phases, args.base, args.token_ids, args.seed, args.slo_factor, log_dir)
        print(f"unloaded 1P1D: TTFT p50/p90 {got['ttft_p50']:.2f}/{got['ttft_p90']:.2f} s (prefill-heavy), TPOT "
              f"p50/p90 {got['tpot_p50'] * 1e3:.0f}/{got['tpot_p90'] * 1e3:.0f} ms (decode-heavy), load average "
              f"{os.getloadavg()[0]:.1f} -> --slo-ttft {got['slo_ttft']:.2f} "
              f"--slo-tpot {got['slo_tpot']:.3f} (x{args.slo_factor:g})")
        return
    try:
        earlier_report(args)  # before any run: runs that could not join it would be lost
    except ValueError as exc:
        sys.exit(f"autoscale.py: error: {exc}")
    deadline = time.monotonic() + args.max_minutes * 60
    runs: list[dict[str, Any]] = []
    try:
        for repeat in range(args.repeats):
            for arm in args.arm_list:
                if time.monotonic() > deadline:
                    raise DeploymentError(f"past --max-minutes {args.max_minutes:g}: stopped before {arm.name} "
                                          f"#{repeat}")
                trace = draw_trace(args.phases, args.seed + repeat, args.token_ids)
                run = {"repeat": repeat, "started": datetime.datetime.now().isoformat(timespec="seconds"),
                       **play(arm, trace, args.base, (args.slo_ttft, args.slo_tpot), args.max_workers, log_dir)}
                print(run_line(run), flush=True)
                runs.append(run)
    except DeploymentError as exc:
        sys.exit(f"autoscale.py: error: {exc}\n(logs: {log_dir})")
    report = report_for(args, runs)
    if args.json_path:
        Path(args.json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_path).write_text(json_text(report))
    print(f"\nSLOs: TTFT {args.slo_ttft:g} s, TPOT {args.slo_tpot * 1e3:g} ms; medians over each arm's runs")
    print(table(report["runs"]))

if __name__ == "__main__":
    main()
