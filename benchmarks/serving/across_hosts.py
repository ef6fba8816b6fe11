"""TTFT and TPOT of 1P1D with its pools on hosts of their own against the same deployment
on one host, per seed, in one run.

    .venv/bin/python -m benchmarks.serving across_hosts                      # 3 seeds, tcp
    .venv/bin/python -m benchmarks.serving across_hosts --transport nixl --link-rate 1gbit

Both layouts are configs/ray-multinode-cpu.yaml submitted with `ray job submit` to a Ray
cluster on the multi-host test bed (benchmarks/netns_cluster; root only): "one host"
runs Ray on host 1 alone, marked prefill_node and decode_node, so the KV push stays on
that host's loopback; "three hosts" puts the router (Ray's head) on host 1, the prefill
pool on host 2 and the decode pool on host 3, so the push crosses the bridge (limited to
--link-rate if given). The client runs on host 1 in both. Each seed draws the same
requests for both layouts (benchmarks/serving/load.py: prompts above the router's 32-token
threshold, so every prompt is prefilled remotely), sent --concurrency at a time after a
warm-up. The layouts run one after the other, each on a fresh bed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

import yaml

_REPO_ROOT = Path(__file__).resolve().parents[2]
if str(_REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(_REPO_ROOT))

from benchmarks.netns_cluster.bed import NetnsCluster, rate_bits  # noqa: E402
from benchmarks.netns_cluster.deployment import KEY, MODEL, REPO, UCX_ACROSS_THE_BED, Deployment  # noqa: E402
from benchmarks.netns_cluster.ray_hosts import RayHosts  # noqa: E402
from benchmarks.serving.load import Workload, run_concurrency  # noqa: E402
from benchmarks.serving.report import summarize  # noqa: E402

ROUTER, PREFILL, DECODE = 1, 2, 3
LAYOUTS = ("one host", "three hosts")


def deploy(layout: str, transport: str, link_rate: str | None, config_dir: Path) -> tuple[NetnsCluster, Deployment]:
    bed = NetnsCluster("pdnetx", 3, owner=os.getpid()).up()
    try:
        ray = RayHosts(bed, head=ROUTER)
        if layout == "one host":
            ray.start_head({"prefill_node": 1, "decode_node": 1}, num_cpus=3)
        else:
            ray.start_head()
            ray.join(PREFILL, {"prefill_node": 1})
            ray.join(DECODE, {"decode_node": 1})
            if link_rate is not None:
                bed.limit(DECODE, link_rate)
        config = yaml.safe_load((REPO / "configs" / "ray-multinode-cpu.yaml").read_text())
        path = config_dir / f"{transport}.yaml"
        path.write_text(yaml.safe_dump({**config, "transport": transport}))
        served = Deployment(bed, ray, ROUTER, job=f"bench-{transport}")
        served.submit(path, UCX_ACROSS_THE_BED if transport == "nixl" else None)
        return bed, served
    except BaseException:
        bed.down()
        raise


def measure(served: Deployment, seed: int, args: argparse.Namespace) -> dict:
    workload = Workload(prompt_len=(args.prompt_min, args.prompt_max), output_len=(args.output_min, args.output_max))
    url = f"http://{served.bed.address(ROUTER)}:8000/v1"
    model = served.call("/v1/models")["data"][0]["id"]
    before = served.workers()["decode-0"]["stats"]
    with served.bed.inside(ROUTER):  # the client's sockets are host 1's
        asyncio.run(run_concurrency(url, model, workload.draw(args.warmup, seed + 1000), 1, "warm-up", KEY))
        results, elapsed = asyncio.run(run_concurrency(url, model, workload.draw(args.requests, seed),
                                                       args.concurrency, f"seed {seed}", KEY))
    after = served.workers()["decode-0"]["stats"]
    summary = summarize(results, elapsed, slo_ttft=float("inf"), slo_tpot=float("inf"))
    summary["remote"] = after["remote"] - before["remote"]
    summary["fallbacks"] = after["fallbacks"] - before["fallbacks"]
    summary["kv_fabric"] = after.get("kv_fabric")
    return summary


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--transport", default="tcp", choices=("tcp", "nixl"))
    p.add_argument("--link-rate", default=None, help="tc rate of the decode host's link, e.g. 1gbit (three hosts)")
    p.add_argument("--requests", type=int, default=16, help="per seed")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--concurrency", type=int, default=2)
    p.add_argument("--prompt-min", type=int, default=100, help="words")
    p.add_argument("--prompt-max", type=int, default=400)
    p.add_argument("--output-min", type=int, default=16)
    p.add_argument("--output-max", type=int, default=48)
    p.add_argument("--out", type=Path, default=None, help="write every run's summary here as JSON")
    args = p.parse_args()
    if args.link_rate is not None:
        rate_bits(args.link_rate)
    if not (MODEL / "config.json").is_file():
        sys.exit(f"no demo model at {MODEL}: run `make model`")
    seeds = [int(s) for s in args.seeds.split(",")]
    runs: dict[str, dict[int, dict]] = {}
    with tempfile.TemporaryDirectory() as config_dir:
        for layout in LAYOUTS:
            bed, served = deploy(layout, args.transport, args.link_rate, Path(config_dir))
            try:
                runs[layout] = {seed: measure(served, seed, args) for seed in seeds}
            finally:
                served.stop()
                bed.down()
    if args.out is not None:
        args.out.write_text(json.dumps(runs, indent=1, default=str))
    print(f"\n1P1D, {args.transport}, {args.requests} requests per seed at concurrency {args.concurrency}; "
          f"p50 per seed, ms\n")
    print("| layout | seed | TTFT p50 | TPOT p50 | remote / fallbacks | failed |")
    print("|---|---:|---:|---:|---|---:|")
    for layout in LAYOUTS:
        for seed, s in runs[layout].items():
            print(f"| {layout} | {seed} | {s['ttft']['p50'] * 1e3:.1f} | {s['tpot']['p50'] * 1e3:.1f} | "
                  f"{s['remote']} / {s['fallbacks']} | {s['failed']} |")
    print("\n| | TTFT p50 (median of seeds) | TPOT p50 (median of seeds) |")
    print("|---|---:|---:|")
    med = {layout: [statistics.median(runs[layout][s][k]["p50"] for s in seeds) for k in ("ttft", "tpot")]
           for layout in LAYOUTS}
    for layout in LAYOUTS:
        print(f"| {layout} | {med[layout][0] * 1e3:.1f} ms | {med[layout][1] * 1e3:.1f} ms |")
    print(f"| three / one | {med['three hosts'][0] / med['one host'][0]:.2f} | "
          f"{med['three hosts'][1] / med['one host'][1]:.2f} |")


if __name__ == "__main__":
    main()
