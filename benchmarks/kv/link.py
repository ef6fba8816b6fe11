"""KV push bandwidth between two hosts of the bed, against the link's rate.

    .venv/bin/python -m benchmarks.kv link                    # the full grid
    .venv/bin/python -m benchmarks.kv link --rates 1gbit --sizes-mib 64 --transports tcp

The sender runs on host 1 and the receiver on host 2 (benchmarks/kv/transfer.py's
timing: write() to the receiver's acknowledgement, median of --repeats after a warm-up);
host 2's link is limited to each rate in turn (tc: the bridge's htb line class toward
it, a tbf on its own end). Each row also shows a plain TCP stream across the same link
in the same run (one connection, the same bytes): the baseline for "unlimited", where
the link's rate is what the kernel's veth and bridge manage on this machine.

nixl runs with UCX_TLS=tcp and UCX_NET_DEVICES=eth0: the bed's hosts share one kernel,
so UCX would otherwise see one machine and move KV through shared memory, never
touching the link (on real hosts without RDMA it picks TCP by itself).
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import threading
import time
from pathlib import Path

_REPO_ROOT = Path(__file__).resolve().parents[2]
if str(_REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(_REPO_ROOT))

from benchmarks.kv.transfer import Placement, run_transport  # noqa: E402
from benchmarks.netns_cluster.bed import NetnsCluster, rate_bits  # noqa: E402
from security import DeploymentSecret  # noqa: E402

SENDER, RECEIVER = 1, 2
DESC_BYTES = 1 << 20  # 32 blocks of 32 KiB per descriptor


def tcp_stream(bed: NetnsCluster, size: int, repeats: int) -> float:
    """Seconds (median) for one TCP connection to carry `size` bytes from the sender's
    host to the receiver's, until the receiver has read them all."""
    with bed.inside(RECEIVER):
        server = socket.create_server((bed.address(RECEIVER), 0))
    server.settimeout(120)
    port, times = server.getsockname()[1], []

    def drain() -> None:
        try:
            conn, _ = server.accept()
        except OSError:  # the server closed: the sender's connect failed
            return
        with conn:
            buf, got = bytearray(1 << 22), 0
            while got < size and (n := conn.recv_into(buf)):
                got += n
            if got == size:
                conn.sendall(b"k")

    payload = memoryview(bytearray(size))
    try:
        for rep in range(-1, repeats):
            reader = threading.Thread(target=drain)
            reader.start()
            with bed.inside(SENDER):
                conn = socket.create_connection((bed.address(RECEIVER), port), timeout=120)
            with conn:
                start = time.perf_counter()
                conn.sendall(payload)
                if conn.recv(1) != b"k":
                    raise RuntimeError(f"the receiver did not get all {size} bytes")
                if rep >= 0:
                    times.append(time.perf_counter() - start)
            reader.join()
    finally:
        server.close()
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--transports", default="tcp,tcp+curve,nixl")
    p.add_argument("--rates", default="1gbit,10gbit,unlimited")
    p.add_argument("--sizes-mib", default="4,64,256")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--name", default="pdnetkv", help="the bed's name (a bed of that name is replaced)")
    args = p.parse_args()
    sizes = [int(s) << 20 for s in args.sizes_mib.split(",")]
    rates = args.rates.split(",")
    for rate in rates:
        if rate != "unlimited":
            rate_bits(rate)
    os.environ.update(UCX_TLS="tcp", UCX_NET_DEVICES="eth0")  # before any agent, the receiver's too
    bed = NetnsCluster(args.name, 2, owner=os.getpid()).up()
    placement = Placement(lambda: bed.inside(SENDER), lambda: bed.inside(RECEIVER),
                          bed.address(SENDER), bed.address(RECEIVER))
    rows = []
    try:
        for rate in rates:
            bed.limit(RECEIVER, None if rate == "unlimited" else rate)
            stream = {size: size * 8 / tcp_stream(bed, size, args.repeats) / 1e9 for size in sizes}
            link = stream[max(sizes)] if rate == "unlimited" else rate_bits(rate) / 1e9
            rows.append((rate, "plain TCP stream", link, stream))
            for label in args.transports.split(","):
                name, _, curve = label.partition("+")
                print(f"[{label} at {rate}]", flush=True)
                gib = run_transport(name, sizes, [DESC_BYTES], args.repeats, placement=placement,
                                    secret=DeploymentSecret.new() if curve else None)
                rows.append((rate, label, link, {s: gib[(s, DESC_BYTES)] * 2**30 * 8 / 1e9 for s in sizes}))
    finally:
        bed.down()
    print(f"\nGbit/s (and % of the link), median of {args.repeats}; link: the tc rate, or for unlimited the "
          f"plain TCP stream's {max(sizes) >> 20} MiB rate\n")
    print("| link | transport | " + " | ".join(f"{s >> 20} MiB" for s in sizes) + " |")
    print("|---|---|" + "---:|" * len(sizes))
    for rate, label, link, gbits in rows:
        cells = " | ".join(f"{gbits[s]:.2f} ({100 * gbits[s] / link:.0f}%)" for s in sizes)
        print(f"| {rate} ({link:.2f} Gbit/s) | {label} | {cells} |")


if __name__ == "__main__":
    main()
