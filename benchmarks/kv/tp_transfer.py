"""One KV write between workers of different TP sizes against one between equal sizes:
bytes, descriptors and time, per transport, between two processes on this machine.

    .venv/bin/python -m benchmarks.kv tp_transfer
    .venv/bin/python -m benchmarks.kv tp_transfer --transports shm --blocks 64 --repeats 7

Each worker is its driver's view of its ranks: one cache per rank holding its KV heads
(rank_pairs.even_head_ranges), in its own /dev/shm file for shm, registered together. A
receiver process reserves destination blocks; this process writes `--blocks` source
blocks into them and times write() to WriteDone (the receiver's acknowledgement). Two
patterns: "runs" (the blocks consecutive on both sides: one run) and "scattered" (no
two destination blocks consecutive: one run per block). Shapes: the demo model's
(models/SmolLM2-135M-Instruct: 30 layers, 3 KV heads of 64, float32, block 16), whose 3
heads split over TP 1 and 3 only, and the same with 4 KV heads, which splits over 1 and
2. Each cell is the median (and the fastest) of --repeats writes after one untimed
warm-up; the descriptors and bytes are the sender's stats for one write.
"""

from __future__ import annotations

import argparse
import mmap
import multiprocessing as mp
import os
import statistics
import sys
import time
import uuid
from multiprocessing.connection import Connection
from pathlib import Path

import msgpack
import torch

_REPO_ROOT = Path(__file__).resolve().parents[2]
if str(_REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(_REPO_ROOT))

from kv_transfer import KVTransport, TransportConfig, WriteDone, WriteFailed, create_transport  # noqa: E402
from kv_transfer.rank_pairs import even_head_ranges  # noqa: E402
from kv_transfer.shm_segments import SHM_DIR  # noqa: E402

LAYERS, BLOCK_SIZE, HEAD_DIM = 30, 16, 64  # the demo model's
# (name, KV heads, [(prefill TP, decode TP)]): the homogeneous pairs first
SHAPES = [("demo (3 KV heads)", 3, [(1, 1), (3, 3), (1, 3), (3, 1)]),
          ("demo, 4 KV heads", 4, [(1, 1), (2, 2), (1, 2), (2, 1)])]


def make_worker(transport: str, name: str, kv_heads: int, tp: int, num_blocks: int) -> tuple[KVTransport, list[str]]:
    """A transport with a TP worker's rank caches registered (faulted in); the /dev/shm
    files made for them (the caller removes them)."""
    t = create_transport(transport, name, TransportConfig(timeout_s=120, cancel_grace_s=5))
    ranges = even_head_ranges(kv_heads, tp)
    caches, files = [], []
    for start, end in ranges:
        shape = (num_blocks, end - start, LAYERS, 2, BLOCK_SIZE, HEAD_DIM)
        if transport == "shm":
            path = os.path.join(SHM_DIR, f"pdserve-kv-bench-{uuid.uuid4().hex}")
            size = torch.Size(shape).numel() * 4
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.ftruncate(fd, size)
                cache = torch.frombuffer(mmap.mmap(fd, size), dtype=torch.float32).view(shape)
            finally:
                os.close(fd)
            files.append(path)
        else:
            cache = torch.empty(shape)
        cache.fill_(1.0)  # every page faulted in, as a serving engine's cache is
        caches.append(cache)
    t.register_kv_cache(caches, "bench", kv_heads, ranges, files or None)
    return t, files


def receiver(conn: Connection, transport: str, kv_heads: int, tp: int, num_blocks: int) -> None:
    t, files = make_worker(transport, "receiver", kv_heads, tp, num_blocks)
    try:
        conn.send_bytes(t.metadata())
        while True:
            t.poll()
            if not conn.poll(0.0002):  # waits, like a worker's step loop: no spinning core
                continue
            cmd = msgpack.unpackb(conn.recv_bytes(), raw=False)
            if cmd["op"] == "exit":
                return
            t.expect(cmd["req"], 1, cmd["blocks"], deadline=time.time() + 300)
            conn.send_bytes(b"ok")
    finally:
        t.close()
        for f in files:
            os.unlink(f)


def patterns(blocks: int) -> dict[str, tuple[list[int], list[int]]]:
    src = list(range(blocks))
    # Stride 37 modulo 96 blocks: never two consecutive destination blocks.
    return {"runs": (src, list(range(blocks, 2 * blocks))),
            "scattered": (src, [blocks + (i * 37) % 96 for i in range(blocks)])}


def run_pair(transport: str, kv_heads: int, p: int, d: int, blocks: int, repeats: int) -> list[dict]:
    num_blocks = blocks + max(blocks, 96)
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=receiver, args=(child, transport, kv_heads, d, num_blocks), daemon=True)
    proc.start()
    sender, files = make_worker(transport, "sender", kv_heads, p, num_blocks)
    rows = []
    try:
        for cache in sender.kv_caches:
            cache.normal_()
        if not conn.poll(120):
            raise TimeoutError("receiver did not start")
        peer = sender.add_peer(conn.recv_bytes())
        for pattern, (src, dst) in patterns(blocks).items():
            times = []
            for rep in range(-1, repeats):  # rep -1: untimed warm-up
                req = f"{pattern}-{rep}"
                conn.send_bytes(msgpack.packb({"op": "expect", "req": req, "blocks": dst}))
                assert conn.recv_bytes() == b"ok"
                before = dict(sender.stats)
                start = time.perf_counter()
                sender.write(peer, req, 1, src, dst, deadline=time.time() + 300)
                while True:
                    events = [e for e in sender.poll() if isinstance(e, (WriteDone, WriteFailed))]
                    if events:
                        break
                    time.sleep(0.00002)
                elapsed = time.perf_counter() - start
                if isinstance(events[0], WriteFailed):
                    raise RuntimeError(events[0].reason)
                if rep >= 0:
                    times.append(elapsed)
            descriptors = sender.stats["descriptors"] - before["descriptors"]
            moved = sender.stats["bytes_written"] - before["bytes_written"]
            rows.append(dict(transport=transport, kv_heads=kv_heads, p=p, d=d, pattern=pattern, bytes=moved,
                             descriptors=descriptors, seconds=statistics.median(times), best=min(times)))
            r = rows[-1]
            print(f"  {transport:3s} kv {kv_heads} TP {p}->{d} {pattern:9s} {moved / 2**20:7.1f} MiB "
                  f"{descriptors:5d} desc {r['seconds'] * 1e3:8.2f} ms (min {r['best'] * 1e3:.2f})", flush=True)
        return rows
    finally:
        try:
            conn.send_bytes(msgpack.packb({"op": "exit"}))
            proc.join(30)
        finally:
            if proc.is_alive():
                proc.kill()
            sender.close()
            for f in files:
                os.unlink(f)


def tcp_data_path(kv_heads: int, pairs: list[tuple[int, int]], blocks: int, repeats: int) -> None:
    """tcp's share of one write in one process over loopback, no control plane: the
    sender's frames, their send and receive, the receiver's copy in; fastest of
    `repeats` (less disturbed by other load than the two-process times)."""
    import zmq

    from kv_transfer.rank_pairs import wire
    from kv_transfer.runs import coalesce
    from kv_transfer.sender import Write

    ctx = zmq.Context()
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    b.connect(f"tcp://127.0.0.1:{a.bind_to_random_port('tcp://127.0.0.1')}")
    src, dst = patterns(blocks)["runs"]
    runs = coalesce(src, dst)
    print(f"\ntcp data path in one process, {kv_heads} KV heads, {blocks} blocks in one run, fastest of {repeats}\n")
    print("| prefill TP -> decode TP | frames | sender's frames ms | send + receive ms | receiver's copy ms |")
    print("|---|---:|---:|---:|---:|")
    for p, d in pairs:
        (sender, _), (receiver_t, _) = (make_worker("tcp", n, kv_heads, tp, 2 * blocks + 32)
                                        for n, tp in (("sender", p), ("receiver", d)))
        peer_ranges = receiver_t.compat.head_ranges
        from kv_transfer.rank_pairs import plan
        pieces = plan(sender.compat.head_ranges, peer_ranges)
        w = Write(1, "receiver", "r", 1, dst, runs, pieces, 0.0, 0.0)
        best = [float("inf")] * 3
        for _ in range(repeats):
            t0 = time.perf_counter()
            frames = sender._data_frames(w)
            t1 = time.perf_counter()
            a.send_multipart(frames, copy=False)
            got = b.recv_multipart(copy=False)
            t2 = time.perf_counter()
            receiver_t._apply("sender", 1, [[d_, n] for _, d_, n in runs], wire(pieces), got, None)
            best = [min(x, y) for x, y in zip(best, (t1 - t0, t2 - t1, time.perf_counter() - t2))]
        print(f"| {p} -> {d} | {len(frames)} | " + " | ".join(f"{x * 1e3:.1f}" for x in best) + " |", flush=True)
        sender.close()
        receiver_t.close()
    a.close(0)
    b.close(0)
    ctx.term()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--transports", default="shm,tcp")
    ap.add_argument("--blocks", type=int, default=64, help="blocks per write (a 1024-token prompt at block 16)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--tcp-data-path", action="store_true",
                    help="only tcp's frames, send + receive and copy in, in one process (4 KV heads)")
    args = ap.parse_args()
    if args.tcp_data_path:
        tcp_data_path(4, [(1, 1), (2, 2), (1, 2), (2, 1)], args.blocks, args.repeats)
        return
    rows = []
    for transport in args.transports.split(","):
        for label, kv_heads, pairs in SHAPES:
            print(f"[{transport}, {label}]", flush=True)
            for p, d in pairs:
                rows += run_pair(transport, kv_heads, p, d, args.blocks, args.repeats)
    print(f"\nOne write of {args.blocks} blocks, median of {args.repeats} (write() to WriteDone)\n")
    print("| transport | KV heads | prefill TP -> decode TP | blocks | MiB moved | descriptors | median ms | min ms "
          "| GiB/s (median) |")
    print("|---|---:|---|---|---:|---:|---:|---:|---:|")
    for r in rows:
        kind = "homogeneous" if r["p"] == r["d"] else "heterogeneous"
        print(f"| {r['transport']} | {r['kv_heads']} | {r['p']} -> {r['d']} ({kind}) | {r['pattern']} | "
              f"{r['bytes'] / 2**20:.1f} | {r['descriptors']} | {r['seconds'] * 1e3:.1f} | {r['best'] * 1e3:.1f} | "
              f"{r['bytes'] / r['seconds'] / 2**30:.2f} |")


if __name__ == "__main__":
    main()
