"""Chaos and soak: a real deployment (`pdserve serve CONFIG`, the local launcher) under
steady Poisson load through its router, while its workers are killed and stopped,
clients hang up mid-stream, bad bodies and floods hit the router, and a stranger
sends messages to the workers' sockets. Then it drains, and checks its targets.

    PYTHONPATH=$PWD .venv/bin/python -m benchmarks.chaos run --minutes 2 --json chaos.json
    PYTHONPATH=$PWD .venv/bin/python -m benchmarks.chaos run --minutes 30    # the soak

Prints a table and writes the report as JSON (--json); exits 1 when a target is
missed, 2 when the run itself could not be made. The targets and what each word
means: benchmarks/chaos/report.py. The schedule (benchmarks/chaos/faults.py) is drawn
from --seed. The deployment: configs/chaos.yaml (1 prefill + 2 decode workers on CPU,
shm). With API keys on the router, pass one with --api-key or $PDSERVE_API_KEY; to
aim the forger at other sockets, --forge-address.

Everything it starts is a descendant in its process group: a SIGTERM makes it stop the
deployment and report; a killpg of its group ends everything.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.chaos.attacks import Forgery, corpus, forge, send_cases  # noqa: E402
from benchmarks.chaos.deploy import Deployment, Sample, free_port  # noqa: E402
from benchmarks.chaos.faults import AttackLane, Event, ProcessLane, schedule  # noqa: E402
from benchmarks.chaos.load import Load, LoadShape, Outcome, flood  # noqa: E402
from benchmarks.chaos.report import decode_down_spans, latency, requests_summary, rss_summary, table, targets  # noqa: E402
from cluster.config import load_cluster_config  # noqa: E402


def _idle(s: Sample) -> bool:
    """Every worker live and answering, nothing in flight or queued anywhere."""
    if s.in_flight != 0 or not s.live or not all(s.live.values()) or not all(s.stats.values()):
        return False
    keys = ("running", "waiting", "waiting_for_kv", "jobs")
    return all(not st.get(k) for st in s.stats.values() for k in keys)


def drain(d: Deployment, timeout_s: float) -> tuple[bool, dict[str, int | None]]:
    """Wait until the deployment is idle with every block free (or timeout_s). Whether it
    got idle, and each worker's blocks not free then."""
    end = time.monotonic() + timeout_s
    idle: Sample | None = None
    while True:
        s = d.sample()
        if s is not None and _idle(s):
            idle = s
            if all(st["free_blocks"] == st["num_blocks"] for st in s.stats.values()):
                break
        if time.monotonic() > end:
            break
        time.sleep(1.0)
    final = idle or d.sample() or d.latest
    return idle is not None, {w: (st["num_blocks"] - st["free_blocks"]) if st else None
                              for w, st in final.stats.items()}


def run(args: argparse.Namespace) -> dict:
    config = load_cluster_config(args.config)
    seconds = args.minutes * 60
    api_key = args.api_key or os.environ.get("PDSERVE_API_KEY") or None
    port = args.port or free_port()
    log = Path(args.log or tempfile.mkstemp(prefix="chaos-serve-", suffix=".log")[1])
    d = Deployment(args.config, port, log, api_key, args.model)
    outcomes: list[Outcome] = []
    forged: list[Forgery] = []
    lanes: list = []
    stop = threading.Event()
    try:
        d.start()
        d.watch(1.0, args.rss_interval)
        first = d.latest
        decode = sorted(n for n in first.live if n.startswith("decode"))
        prefill = sorted(n for n in first.live if n.startswith("prefill"))
        cases = [c for c in corpus() if not any(x in c[0] for x in args.fuzz_exclude)]
        cases *= max(1, round(args.minutes / 10))
        random.Random(args.seed).shuffle(cases)
        parts = max(3, round(args.minutes * 2))
        events = schedule(args.seed, seconds, args.fault_decode or decode[0], prefill[0] if prefill else "", parts,
                          args.faults_per_lane)
        if not prefill:
            events = [e for e in events if e.lane != "prefill"]
        given = {a: a for a in args.forge_address}

        def on_fuzz(e: Event) -> None:
            outcomes.extend(send_cases(port, cases[e.part::parts], api_key))

        def on_flood(e: Event) -> None:
            outcomes.extend(flood(port, args.flood_factor * config.router.max_queued_requests, api_key))

        def on_forge(e: Event) -> None:
            live = {n: a for n, a in d.latest.addresses.items() if d.latest.live.get(n)}
            forged.extend(forge(given or live, generate_to=set(given) or set(decode)))

        load = Load(port, args.seed, LoadShape(rate=args.rate), api_key)
        t0 = time.monotonic()
        load.start()
        lanes = [ProcessLane(d, [e for e in events if e.lane == lane], t0, stop) for lane in ("prefill", "decode")]
        attack = AttackLane([e for e in events if e.lane == "attack"], t0, stop,
                            {"fuzz": on_fuzz, "flood": on_flood, "forge": on_forge})
        for lane in (*lanes, attack):
            lane.thread.start()
        stop.wait(seconds)
        stop.set()  # the faults and attacks left run now, one after another, under load
        for lane in (*lanes, attack):
            lane.thread.join()  # each fault has recovered
        t_load = time.monotonic()
        still = load.stop(args.request_timeout)
        outcomes.extend(load.outcomes)
        drained, leaked = drain(d, args.drain_timeout)
        t_end = time.monotonic()
    finally:
        stop.set()
        rc = d.stop()
    faults = [f for lane in lanes for f in lane.faults]
    down = decode_down_spans(faults, decode, t_end)
    requests = requests_summary(outcomes, down)
    rss = rss_summary(d.rss, t0, t_load, args.rss_warmup if args.rss_warmup is not None else min(300.0, 0.3 * seconds))
    fuzz = [o for o in outcomes if o.kind == "fuzz"]
    report = {
        "command": " ".join(sys.argv), "config": args.config, "seed": args.seed, "load_seconds": t_load - t0,
        "drain_seconds": t_end - t_load, "requests_unfinished_at_drain": still, "serve_exit_status": rc,
        "serve_log": str(log), "requests": requests, "all_decode_down_s": sum(b - a for a, b in down),
        "faults": [f.to_json() | {"start": f.start - t0, "end": f.end - t0 if f.end else None} for f in faults],
        "latency": latency(outcomes, faults, t_end), "leaked_blocks": leaked, "drained": drained,
        "rss": rss, "rss_series": [(round(t - t0, 1), *rest) for t, *rest in d.rss],
        "fuzz": [{"case": o.name, "cause": o.cause, "status": o.status, "detail": o.detail} for o in fuzz],
        "outcomes": [[o.kind, o.name, round(o.start - t0, 2), round(o.end - o.start, 2), o.cause, o.tokens]
                     for o in sorted(outcomes, key=lambda o: o.start)],
        "forged": [f.to_json() | {"at": f.at - t0} for f in forged],
    }
    report["targets"] = targets(requests, leaked, fuzz, down, rss, forged, args.rss_tolerance, drained)
    report["passed"] = all(t["ok"] for t in report["targets"])
    return report


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/chaos.yaml")
    p.add_argument("--model", default=None, help="the model directory (default: the config's)")
    p.add_argument("--minutes", type=float, default=2.0, help="of load and faults (the soak target: 30)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rate", type=float, default=0.5, help="steady load, requests per second")
    p.add_argument("--port", type=int, default=None, help="the router's (default: a free one)")
    p.add_argument("--api-key", default=None, help="sent as Authorization: Bearer (default: $PDSERVE_API_KEY)")
    p.add_argument("--faults-per-lane", type=int, default=None,
                   help="kills, and as many stops, of each faulted worker (default: one a minute, at least 2)")
    p.add_argument("--fault-decode", default=None, help="the decode worker to fault (default: the first)")
    p.add_argument("--forge-address", action="append", default=[], metavar="ZMQ_ADDRESS",
                   help="send the forged messages here instead of to every worker /status lists (repeatable)")
    p.add_argument("--fuzz-exclude", action="append", default=[], metavar="TEXT",
                   help="leave out the fuzz cases whose name contains TEXT (to find which input hurts; repeatable)")
    p.add_argument("--flood-factor", type=int, default=3, help="a flood is this many x router.max_queued_requests")
    p.add_argument("--rss-interval", type=float, default=2.0, help="seconds between VmRSS samples")
    p.add_argument("--rss-warmup", type=float, default=None, help="seconds (default: 30%% of the run, at most 300)")
    p.add_argument("--rss-tolerance", type=float, default=0.05, help="the memory-flat target's growth bound")
    p.add_argument("--request-timeout", type=float, default=120.0)
    p.add_argument("--drain-timeout", type=float, default=45.0)
    p.add_argument("--log", default=None, help="pdserve serve's output (default: a temporary file)")
    p.add_argument("--json", dest="json_path", default=None)
    args = p.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(2))  # unwinds through run()'s cleanup
    try:
        report = run(args)
    except RuntimeError as exc:
        print(f"chaos: the run could not be made: {exc}", file=sys.stderr)
        return 2
    print(table(report))
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(report, indent=1))
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
