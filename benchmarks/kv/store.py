"""The shared KV store from a worker on its host: puts and fetches over the store's
same-host Unix socket against CURVE TCP (kv_store/local_endpoint.py), the store in a
process of its own as the local launcher starts it.

    python -m benchmarks.kv store [--blocks 300] [--block-kb 720] [--rounds 5]

Per arm and round: N blocks put (the worker's client sends them without waiting, as the
tiers' I/O thread does) until the store holds them all, then fetched back in chains of
32. Reported per block, medians over the rounds (the arms alternate): wall time, and CPU
time of the worker's process and of the store's process together (what both take from
the cores that run the model).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import psutil

from cluster.config import ClusterConfig
from cluster.local.kv_store import start_store
from engine.kv_cache.shared_tier import SharedBlock
from kv_store import StoreClient
from security import DeploymentSecret

FETCH_CHAIN = 32


def cpu_s(*processes: psutil.Process) -> float:
    total = 0.0
    for p in processes:
        t = p.cpu_times()
        total += t.user + t.system
    return total


def one_round(address: str, secret: DeploymentSecret, store: psutil.Process, same_host: bool, blocks: int,
              block_bytes: int, namespace: int) -> dict[str, float]:
    client = StoreClient(address, secret, fetch_timeout_s=10.0, same_host=same_host)
    client.open(namespace)
    payload = os.urandom(block_bytes)
    me = psutil.Process()
    try:
        client.fetch([1])  # connected (and the sync thread's socket too) before the clock starts
        cpu0, t0 = cpu_s(me, store), time.perf_counter()
        for h in range(2, blocks + 2):
            while True:  # a full send queue drops a put (a cache may): here, send it again
                before = client.dropped_puts
                client.put(SharedBlock(h, h - 1, (h,), 0, payload))
                if client.dropped_puts == before:
                    break
                time.sleep(0.0005)
        while len(client.fetch([blocks + 1])) != 1:  # the last one is held: all are (one socket, in order)
            time.sleep(0.0005)
        cpu1, t1 = cpu_s(me, store), time.perf_counter()
        for start in range(2, blocks + 2, FETCH_CHAIN):
            chain = list(range(start, min(start + FETCH_CHAIN, blocks + 2)))
            assert len(client.fetch(chain)) == len(chain)
        cpu2, t2 = cpu_s(me, store), time.perf_counter()
        assert client.endpoint.startswith("ipc://" if same_host else "tcp://"), client.endpoint
    finally:
        client.close()
    return {"put_ms": (t1 - t0) / blocks * 1e3, "put_cpu_ms": (cpu1 - cpu0) / blocks * 1e3,
            "fetch_ms": (t2 - t1) / blocks * 1e3, "fetch_cpu_ms": (cpu2 - cpu1) / blocks * 1e3}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--blocks", type=int, default=300)
    p.add_argument("--block-kb", type=int, default=720, help="720: a 16-token block of the demo model in float32")
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    secret = DeploymentSecret.new()
    capacity_gib = 2 * args.blocks * args.block_kb / 2**20 + 0.1
    config = ClusterConfig.from_dict({"model": "unused", "kv_store": {"enabled": True, "capacity_gib": capacity_gib},
                                      "decode": {"engine": {"kv_offload_gib": 1}}})
    store = start_store(config, secret)
    results: dict[str, list[dict[str, float]]] = {"unix socket": [], "CURVE TCP": []}
    try:
        proc = psutil.Process(store.process.pid)
        for r in range(args.rounds):
            arms = [("unix socket", True), ("CURVE TCP", False)]
            for name, same_host in arms if r % 2 == 0 else arms[::-1]:
                results[name].append(one_round(store.address, secret, proc, same_host, args.blocks,
                                               args.block_kb << 10, namespace=100 * r + same_host))
    finally:
        store.stop()
    print(f"{args.blocks} blocks of {args.block_kb} KB, medians of {args.rounds} rounds (arms alternating)\n")
    print("| path | put ms/block | put CPU ms/block | fetch ms/block | fetch CPU ms/block |")
    print("|---|---:|---:|---:|---:|")
    for name, rounds in results.items():
        med = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
        print(f"| {name} | {med['put_ms']:.3f} | {med['put_cpu_ms']:.3f} | {med['fetch_ms']:.3f} | "
              f"{med['fetch_cpu_ms']:.3f} |")


if __name__ == "__main__":
    main()
