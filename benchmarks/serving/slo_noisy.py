"""benchmarks/serving/slo.py's noisy neighbour: two API keys on one 1P1D deployment. The
quiet key sends steady interactive traffic at --quiet-load x capacity; the noisy key
floods at --noisy-factor x its share (capacity / 2); --noisy-duration s of arrivals per
run. Two deployments, one per arm:

  fair  router.key_weights [1, 1] and router.slo.policy reject: the quiet key's p99
        TTFT is measured alone, then with the noisy key
  fcfs  no key_weights, policy off (today's behaviour): with the noisy key only

The ratio (fair with noisy) / alone is the issue's figure (target <= 1.5); (fcfs with
noisy) / alone shows what fair queuing saves."""

from __future__ import annotations

import argparse
import asyncio
import secrets
from pathlib import Path
from typing import Any

from benchmarks.elastic.deployment import Deployment
from benchmarks.serving.load import Workload
from benchmarks.serving.server import server_model
from benchmarks.serving.slo_load import SLOClass, draw_trace, run_open_loop, summarize
from benchmarks.serving.slo_setup import Live, arm_config

TOPOLOGY = "1p1d"
ARMS = {"fair": ("reject", [1.0, 1.0]), "fcfs": ("off", None)}
NOISY_SEED_OFFSET = 1000  # the noisy key's trace: another seed than the quiet key's


def run_noisy(args: argparse.Namespace, base: dict[str, Any], workload: Workload, capacity: float,
              quiet_slo: SLOClass, noisy_slo: SLOClass, log_dir: Path) -> list[dict[str, Any]]:
    """Every (arm, seed, phase) of the experiment, a dict each (slo_report.noisy_rows)."""
    keys = {"quiet": f"sk-quiet-{secrets.token_hex(12)}", "noisy": f"sk-noisy-{secrets.token_hex(12)}"}
    quiet_rate = args.quiet_load * capacity
    noisy_rate = args.noisy_factor * capacity / 2
    print(f"noisy neighbour ({TOPOLOGY}): quiet {quiet_rate:.2f} req/s ({quiet_slo.name}), "
          f"noisy {noisy_rate:.2f} req/s ({noisy_slo.name}), {args.noisy_duration:g} s, seeds {args.seeds}, "
          f"prefill max_num_batched_tokens {args.noisy_prefill_tokens or 'from --config'}", flush=True)
    runs = []
    for arm in args.noisy_arms:
        policy, weights = ARMS[arm]
        config = arm_config(base, TOPOLOGY, policy, args.remote_min, list(keys.values()), weights)
        if args.noisy_prefill_tokens is not None:
            engine = config["prefill"]["engine"]
            config["prefill"]["engine"] = {**engine, "max_num_batched_tokens": args.noisy_prefill_tokens}
        with Deployment(config, log_dir / f"noisy-{arm}", keep_api_keys=True) as d:
            live = Live(d, server_model(d.url, keys["quiet"]), workload, keys["quiet"])
            live.warm_up(args.concurrency, args.warmup_s, keys["quiet"])
            for seed in args.seeds:
                phases = ("alone", "noisy") if arm == "fair" else ("noisy",)
                for phase in phases:
                    trace = draw_trace(workload, seed, quiet_rate, args.noisy_duration, [quiet_slo], key="quiet")
                    if phase == "noisy":
                        trace += draw_trace(workload, seed + NOISY_SEED_OFFSET, noisy_rate, args.noisy_duration,
                                            [noisy_slo], key="noisy")
                    elapsed = asyncio.run(run_open_loop(d.url, live.model, trace, keys))
                    run = {"arm": arm, "phase": phase, "seed": seed, "elapsed_s": elapsed,
                           "quiet": summarize([s for s in trace if s.key == "quiet"], elapsed, args.noisy_duration),
                           "noisy": summarize([s for s in trace if s.key == "noisy"], elapsed, args.noisy_duration)
                           if phase == "noisy" else None,
                           "status_slo": live.status().get("slo")}
                    runs.append(run)
                    q = run["quiet"]
                    print(f"  noisy {arm:4} seed {seed} {phase:5}: quiet p99 TTFT {q['ttft']['p99'] * 1000:.0f} ms, "
                          f"good {q['good']}/{q['requests']}, rejected {q['rejected']} {q['rejected_by']}"
                          + (f"; noisy rejected {run['noisy']['rejected']}/{run['noisy']['requests']}"
                             if run["noisy"] else ""), flush=True)
                    live.drain(args.idle_s)
    return runs
