"""The nccl transport's pair set-up with torch's TCPStore (no deployment secret) and
with the authenticated store (kv_transfer/auth_store.py), between two processes on this
machine (gloo on CPU).

    .venv/bin/python -m benchmarks.kv nccl_rendezvous
    .venv/bin/python -m benchmarks.kv nccl_rendezvous --repeats 21

A receiver process registers its cache and polls; this process, for each repeat, makes
a new sender, and times add_peer() + warm_up(): the handshake, the join message, and
the pairwise group's rendezvous through the receiver's store, until the group exists
on both sides. Also timed: register_kv_cache() of a receiver, which starts its store
(a TCPStore, or a StoreServer thread and its guard). Writes are not timed: once the
group exists they travel over gloo's (or NCCL's) own connections either way.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import sys
import time
from multiprocessing.connection import Connection
from pathlib import Path

import torch

_REPO_ROOT = Path(__file__).resolve().parents[2]
if str(_REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(_REPO_ROOT))

from kv_transfer import KVTransport, TransportConfig, create_transport  # noqa: E402
from security import DeploymentSecret  # noqa: E402

SHAPE = (64, 2, 2, 2, 16, 32)  # a small cache: the set-up does not depend on its size


def agent(name: str, secret_hex: str | None) -> KVTransport:
    secret = DeploymentSecret.from_hex(secret_hex) if secret_hex else None
    t = create_transport("nccl", name, TransportConfig(timeout_s=20.0, secret=secret))
    t.register_kv_cache(t.allocate_kv_cache(SHAPE, torch.float32, "cpu"), "bench")
    return t


def receiver(conn: Connection, secret_hex: str | None) -> None:
    t = agent("decode", secret_hex)
    conn.send_bytes(t.metadata())
    while not conn.poll(0):
        t.poll()
        time.sleep(0.0005)
    t.close()


def measure(secret_hex: str | None, repeats: int) -> tuple[list[float], list[float]]:
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=receiver, args=(child, secret_hex), daemon=True)
    proc.start()
    try:
        metadata = conn.recv_bytes()
        setups, registers = [], []
        for i in range(repeats + 1):  # the first is a warm-up
            start = time.perf_counter()
            sender = agent("prefill", secret_hex)
            registered = time.perf_counter()
            sender.warm_up(sender.add_peer(metadata))
            done = time.perf_counter()
            sender.close()
            if i:
                registers.append(registered - start)
                setups.append(done - registered)
        return setups, registers
    finally:
        conn.send_bytes(b"stop")
        proc.join(30)
        if proc.is_alive():
            proc.kill()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    print(f"{'store':<22} {'pair set-up ms (median, min)':>30} {'register ms (median)':>22}")
    for label, secret in [("TCPStore (no secret)", None), ("authenticated store", DeploymentSecret.new().hex)]:
        setups, registers = measure(secret, args.repeats)
        print(f"{label:<22} {statistics.median(setups) * 1e3:>21.1f} {min(setups) * 1e3:>8.1f} "
              f"{statistics.median(registers) * 1e3:>22.1f}")


if __name__ == "__main__":
    main()
