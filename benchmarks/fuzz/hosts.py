"""More seeds of the multi-host fault fuzzer (tests/fuzz/hosts.py) than `make
test-multihost` runs: random partitions and slow links on a 4-host deployment (network
namespaces; root only) while random greedy requests stream, every answer checked
against the colocated oracle.

    .venv/bin/python -m benchmarks.fuzz hosts --seeds 0-9

One deployment serves every seed (about a minute to bring up). Prints one line per seed
and the failures (exit status 1 if any)."""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.fuzz.scale import seeds  # noqa: E402
from benchmarks.netns_cluster.bed import NetnsCluster  # noqa: E402
from benchmarks.netns_cluster.deployment import MODEL, Deployment  # noqa: E402
from benchmarks.netns_cluster.ray_hosts import RayHosts  # noqa: E402
from engine import LLM  # noqa: E402
from tests.fuzz.hosts import DECODES, PREFILL, ROUTER, TextOracle, run_hosts_seed, write_config  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="0-9")
    parser.add_argument("--requests", type=int, default=12)
    parser.add_argument("--events", type=int, default=4)
    args = parser.parse_args()
    oracle = TextOracle(LLM(str(MODEL), dtype="float32", num_kv_blocks=256, num_threads=1))
    failures: list[str] = []
    bed = NetnsCluster("pdnetfz", 1 + 1 + len(DECODES), owner=os.getpid()).up()
    try:
        ray = RayHosts(bed, head=ROUTER)
        ray.start_head()
        ray.join(PREFILL, {"prefill_node": 1})
        for host in DECODES:
            ray.join(host, {"decode_node": 1})
        with tempfile.TemporaryDirectory() as tmp:
            served = Deployment(bed, ray, ROUTER).submit(write_config(Path(tmp) / "four-hosts.yaml"))
            try:
                for seed in seeds(args.seeds):
                    start = time.monotonic()
                    found = run_hosts_seed(served, oracle, seed, args.requests, args.events)
                    failures += found
                    print(f"seed {seed}: {args.requests} requests, {args.events} faults, "
                          f"{len(found)} failures, {time.monotonic() - start:.0f} s", flush=True)
            finally:
                served.stop()
    finally:
        bed.down()
    print("\n".join(failures) or "no failures")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
