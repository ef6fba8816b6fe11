"""KV transfer bandwidth per transport, between two processes on this machine.

    .venv/bin/python -m benchmarks.kv transfer                       # all transports, full grid
    .venv/bin/python -m benchmarks.kv transfer --transports shm,nixl --sizes-mib 256 --desc-kib 1024
    .venv/bin/python -m benchmarks.kv transfer --transports tcp --secret both    # CURVE's cost

A receiver process reserves destination blocks; this process writes source blocks into
them through the transport and times write() to WriteDone (the receiver's
acknowledgement), so every figure includes the notification round trip. A transfer of
S bytes in descriptors of R bytes is S/R runs of R/block_bytes consecutive blocks; the
runs land in reverse order on the receiver, so no two of them coalesce into one
descriptor. Both caches are touched before timing (no first-touch page faults), and
each cell is the median of --repeats transfers after one untimed warm-up;
GiB/s = S / seconds. --secret: plain sockets (as a transport made alone), the
control plane of a deployment (a shared DeploymentSecret: CURVE, every frame encrypted,
which the tcp transport's data frames pay too), or both, one after the other, with
their ratio.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing as mp
import statistics
import sys
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path

import msgpack
import torch

_REPO_ROOT = Path(__file__).resolve().parents[2]
if str(_REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(_REPO_ROOT))

from kv_transfer import TransportConfig, WriteDone, WriteFailed, create_transport  # noqa: E402
from security import DeploymentSecret  # noqa: E402

# A block is 2 heads x layers x K/V x 16 tokens x 32 dims x fp32: 8 KiB a layer, 32 KiB
# by default. A real model's block is larger (Llama-3.2-1B in bf16: 512 KiB), and the
# control plane's cost is per block, so --block-kib 512 shows what such a model sees.
LAYER_BYTES, BLOCK_SIZE, KV_HEADS, HEAD_DIM = 8 << 10, 16, 2, 32
BLOCK_BYTES = 4 * LAYER_BYTES


def shape(num_blocks: int, block_bytes: int) -> tuple[int, ...]:
    return (num_blocks, KV_HEADS, block_bytes // LAYER_BYTES, 2, BLOCK_SIZE, HEAD_DIM)


@dataclass(frozen=True)
class Placement:
    """Where each side runs: `sender`/`receiver` move the calling thread onto its host
    (what it starts or opens meanwhile is that host's), and each side's transport binds
    its host's address. The default: both on this machine's loopback."""

    sender: Callable[[], AbstractContextManager[None]] = contextlib.nullcontext
    receiver: Callable[[], AbstractContextManager[None]] = contextlib.nullcontext
    sender_host: str = "127.0.0.1"
    receiver_host: str = "127.0.0.1"


def receiver(conn: Connection, transport: str, num_blocks: int, device: str, block_bytes: int,
             secret: DeploymentSecret | None, host: str = "127.0.0.1") -> None:
    t = create_transport(transport, "receiver", TransportConfig(timeout_s=120, cancel_grace_s=5, secret=secret,
                                                                host=host))
    cache = t.allocate_kv_cache(shape(num_blocks, block_bytes), torch.float32, device)
    cache.fill_(1.0)  # fault every page in now, as a serving engine's cache would be
    t.register_kv_cache(cache, "bench")
    conn.send_bytes(t.metadata())
    while True:
        t.poll()
        if not conn.poll(0.0002):  # waits, like a worker's step loop: no spinning core
            continue
        cmd = msgpack.unpackb(conn.recv_bytes(), raw=False)
        if cmd["op"] == "exit":
            t.close()
            return
        t.expect(cmd["req"], 1, cmd["blocks"], deadline=time.time() + 300)
        conn.send_bytes(b"ok")


def run_transport(name: str, sizes: list[int], descs: list[int], repeats: int,
                  device: str = "cpu", block_bytes: int = BLOCK_BYTES,
                  secret: DeploymentSecret | None = None,
                  placement: Placement = Placement()) -> dict[tuple[int, int], float]:
    """GiB/s per (transfer bytes, descriptor bytes), median of `repeats`; both agents
    with `secret` (None: plain sockets), placed by `placement`."""
    if block_bytes % LAYER_BYTES or any(d % block_bytes for d in descs):
        raise ValueError(f"blocks are whole {LAYER_BYTES >> 10} KiB layers and descriptors whole blocks")
    num_blocks = max(sizes) // block_bytes
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=receiver, args=(child, name, num_blocks, device, block_bytes, secret,
                                              placement.receiver_host), daemon=True)
    with placement.receiver():  # a process started here lives on the receiver's host
        proc.start()
    with placement.sender():
        return _send(name, sizes, descs, repeats, device, block_bytes, num_blocks, secret, placement.sender_host,
                     conn, proc)


def _send(name: str, sizes: list[int], descs: list[int], repeats: int, device: str, block_bytes: int,
          num_blocks: int, secret: DeploymentSecret | None, host: str, conn: Connection,
          proc: mp.process.BaseProcess) -> dict[tuple[int, int], float]:
    sender = create_transport(name, "sender", TransportConfig(timeout_s=120, secret=secret, host=host))
    try:
        cache = sender.allocate_kv_cache(shape(num_blocks, block_bytes), torch.float32, device)
        cache.normal_()
        sender.register_kv_cache(cache, "bench")
        if not conn.poll(120):
            raise TimeoutError("receiver did not start")
        peer = sender.add_peer(conn.recv_bytes())
        results = {}
        for size in sizes:
            for desc in descs:
                run = desc // block_bytes
                runs = size // desc
                src = list(range(runs * run))
                dst = [b for i in reversed(range(runs)) for b in range(i * run, (i + 1) * run)]
                times, posts = [], []
                for rep in range(-1, repeats):  # rep -1: untimed warm-up
                    req = f"{size}-{desc}-{rep}"
                    conn.send_bytes(msgpack.packb({"op": "expect", "req": req, "blocks": dst}))
                    assert conn.recv_bytes() == b"ok"
                    start = time.perf_counter()
                    sender.write(peer, req, 1, src, dst, deadline=time.time() + 300)
                    posted = time.perf_counter()
                    while True:
                        events = [e for e in sender.poll() if isinstance(e, (WriteDone, WriteFailed))]
                        if events:
                            break
                        time.sleep(0.00002)
                    if isinstance(events[0], WriteFailed):
                        raise RuntimeError(events[0].reason)
                    if rep >= 0:
                        times.append(time.perf_counter() - start)
                        posts.append(posted - start)
                results[(size, desc)] = size / statistics.median(times) / 2**30
                # How long write() itself took (the host's share: descriptors, posting)
                # tells a fixed per-transfer cost from a bandwidth limit.
                print(f"  {name:5s} {size >> 20:5d} MiB in {desc >> 10:5d} KiB descriptors: "
                      f"{results[(size, desc)]:6.2f} GiB/s ({statistics.median(times) * 1e3:.2f} ms, "
                      f"write() {statistics.median(posts) * 1e3:.2f} ms)", flush=True)
        return results
    finally:
        try:
            conn.send_bytes(msgpack.packb({"op": "exit"}))
            proc.join(30)
        finally:
            if proc.is_alive():
                proc.kill()
            sender.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--transports", default="shm,nixl,nccl,tcp")
    p.add_argument("--sizes-mib", default="64,256,1024")
    p.add_argument("--desc-kib", default="32,256,1024,4096")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--device", default="cpu", help="cpu, or cuda for nixl/cuda_ipc on one GPU")
    p.add_argument("--block-kib", type=int, default=BLOCK_BYTES >> 10, help="KV block size (whole 8 KiB layers)")
    p.add_argument("--secret", choices=("plain", "curve", "both"), default="plain",
                   help="plain sockets, a deployment secret's (CURVE), or both and their ratio")
    args = p.parse_args()
    sizes = [int(s) << 20 for s in args.sizes_mib.split(",")]
    descs = [int(d) << 10 for d in args.desc_kib.split(",")]
    modes = {"plain": ["plain"], "curve": ["curve"], "both": ["plain", "curve"]}[args.secret]
    table = {}
    for name in args.transports.split(","):
        for mode in modes:
            label = name if mode == "plain" else f"{name}+curve"
            print(f"[{label}]", flush=True)
            table[label] = run_transport(name, sizes, descs, args.repeats, args.device, args.block_kib << 10,
                                         DeploymentSecret.new() if mode == "curve" else None)
    print("\nGiB/s, median of", args.repeats, "transfers (write() to the receiver's acknowledgement)\n")
    print("| transport | transfer | " + " | ".join(f"{d >> 10} KiB desc" for d in descs) + " |")
    print("|---|---:|" + "---:|" * len(descs))
    for name, res in table.items():
        for size in sizes:
            print(f"| {name} | {size >> 20} MiB | " + " | ".join(f"{res[(size, d)]:.2f}" for d in descs) + " |")
    if len(modes) == 2:
        print("\nCURVE / plain bandwidth\n")
        for name in args.transports.split(","):
            for size in sizes:
                print(f"| {name} | {size >> 20} MiB | " + " | ".join(
                    f"{table[f'{name}+curve'][(size, d)] / table[name][(size, d)]:.2f}" for d in descs) + " |")


if __name__ == "__main__":
    main()
