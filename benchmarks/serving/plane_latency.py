"""What the worker plane's CURVE sockets cost a small served request, end to end.

    .venv/bin/python -m benchmarks.serving plane_latency --config configs/local.yaml --requests 60

Starts the config's deployment twice, side by side: with plain sockets, and as
launched (the deployment's secret: CURVE between router and workers and between
workers, a tagged KV handshake). Then times --requests non-streamed completions of
--max-tokens tokens through each router, one at a time, alternating between the two
(after --warmup untimed pairs), so that whatever else loads the machine falls on
both alike. Prints each one's median and p90, and the ratios.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

# The repo root first, as in serve.py.
_REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(_REPO_ROOT))

import httpx2 as httpx  # noqa: E402

import cluster.local.workers as local_workers  # noqa: E402
from cluster.config import load_cluster_config  # noqa: E402
from cluster.serve import HTTPServer, build  # noqa: E402
from security import DeploymentSecret  # noqa: E402


class _NoSecret:
    """Stands in for DeploymentSecret in the launcher for the plain baseline only: a
    launched deployment always has a secret, so there is no switch for this."""

    @staticmethod
    def new() -> None:
        return None


@contextmanager
def deployment(config, secure: bool, port: int) -> Iterator[str]:
    """The config's deployment, plain or as launched, served on `port`; its base URL."""
    local_workers.DeploymentSecret = DeploymentSecret if secure else _NoSecret
    try:
        workers, router = build(config)
    finally:
        local_workers.DeploymentSecret = DeploymentSecret
    try:
        assert (workers.secret is not None) == secure
        http = HTTPServer(router, "127.0.0.1", port)
        try:
            yield f"{http.url}/v1"
        finally:
            http.stop()
    finally:
        workers.stop()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="configs/local.yaml")
    p.add_argument("--requests", type=int, default=60, help="timed requests to each deployment")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--ports", type=int, nargs=2, default=[8123, 8124])
    args = p.parse_args()
    config = load_cluster_config(args.config)
    if config.launcher != "local":
        raise SystemExit("a local config: the plain baseline swaps the local launcher's secret out")
    body = {"model": config.model, "prompt": "The capital of France is", "max_tokens": args.max_tokens,
            "temperature": 0.0, "ignore_eos": True}
    times: dict[bool, list[float]] = {False: [], True: []}
    with deployment(config, False, args.ports[0]) as plain, deployment(config, True, args.ports[1]) as curve, \
            httpx.Client(timeout=60) as client:
        for i in range(args.warmup + args.requests):
            for secure in ((False, True) if i % 2 == 0 else (True, False)):
                start = time.perf_counter()
                client.post(f"{curve if secure else plain}/completions", json=body).raise_for_status()
                if i >= args.warmup:
                    times[secure].append(time.perf_counter() - start)
    ratios = sorted(c / p for p, c in zip(times[False], times[True]))
    print(f"| sockets | median latency ({args.max_tokens} tokens) | p90 |\n|---|---:|---:|")
    for secure, name in ((False, "plain"), (True, "CURVE")):
        print(f"| {name} | {statistics.median(times[secure]) * 1e3:.1f} ms | "
              f"{statistics.quantiles(times[secure], n=10)[-1] * 1e3:.1f} ms |")
    print(f"\nCURVE / plain: ratio of medians {statistics.median(times[True]) / statistics.median(times[False]):.3f}, "
          f"median of paired ratios {statistics.median(ratios):.3f} ({args.requests} pairs)")


if __name__ == "__main__":
    main()
