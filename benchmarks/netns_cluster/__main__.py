"""python -m benchmarks.netns_cluster up [--hosts N] [--rate R] [--name NAME] | down [--name NAME] | sweep

up: N hosts (namespaces NAME-h1..N at 10.88.0.1..N, joined by a bridge in NAME-br),
each link limited to R if given ("1gbit", "100mbit"); it lasts until `down`. Enter a
host with `ip netns exec NAME-hI COMMAND`. down: kill every process in the bed's
namespaces, remove them and what the processes left in /dev/shm. sweep: remove beds
whose owner died and namespaces a crash left.
"""

from __future__ import annotations

import argparse
import sys

from benchmarks.netns_cluster.bed import BedUnavailable, NetnsCluster, sweep, teardown


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.netns_cluster", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="build the hosts")
    up.add_argument("--hosts", type=int, default=3)
    up.add_argument("--rate", default=None, help="tc rate of every link, e.g. 1gbit (default: none)")
    up.add_argument("--name", default="pdnet")
    down = sub.add_parser("down", help="remove the hosts and everything in them")
    down.add_argument("--name", default="pdnet")
    sub.add_parser("sweep", help="remove what crashed beds left")
    args = parser.parse_args(argv)
    try:
        if args.command == "up":
            bed = NetnsCluster(args.name, args.hosts, args.rate).up()
            for host in range(1, bed.hosts + 1):
                print(f"{bed.namespace(host)}\t{bed.address(host)}")
        elif args.command == "down":
            teardown(args.name)
        else:
            print("\n".join(sweep()) or "nothing to sweep")
    except (BedUnavailable, ValueError) as e:
        print(f"netns_cluster: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
