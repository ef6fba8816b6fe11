"""How fast a Ray deployment notices a crashed worker and has it back in service.

    .venv/bin/python -m benchmarks.chaos ray_recovery                # the demo model, 3 kills per role
    .venv/bin/python -m benchmarks.chaos ray_recovery --model DIR --kills 5 --probe-interval 0.5

Serves configs/ray-local.yaml's shape (1 prefill + 1 decode actor on a private local
Ray, shm transport) in this process, then, per kill, SIGKILLs one worker actor's
process and times, from the kill:

  down     the supervisor has declared it down and told its peers and the router
           (with ray.probe_interval_s and ray.probe_timeout_s as given)
  back     Ray restarted the actor, it loaded the model, took its peers and is back in
           the router's rotation (supervisor: wired back in)
  served   a request that needs it (a greedy completion; for the prefill worker, a
           prompt long enough to be prefilled remotely) has been answered by it

It prints a table of medians (and min-max) per role, the command included.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import secrets
import signal
import statistics
import sys
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # stay on 127.0.0.1
# Token auth on, as in production (README): a token of this run's own unless one is set.
os.environ.setdefault("RAY_AUTH_MODE", "token")
os.environ.setdefault("RAY_AUTH_TOKEN", secrets.token_hex(32))

import httpx2 as httpx  # noqa: E402
import ray  # noqa: E402

from cluster import demo_model as demo  # noqa: E402
from cluster.config import load_cluster_config  # noqa: E402
from cluster.ray.workers import RayWorker, RayWorkers  # noqa: E402
from cluster.serve import HTTPServer, build  # noqa: E402
from tests.disagg.test_worker_processes import Client  # noqa: E402
from tests.http_server import free_port  # noqa: E402

LONG_PROMPT = "Paged attention keeps keys and values in fixed-size blocks of the cache. " * 8


def wait(condition, timeout: float, what: str) -> float:
    end = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > end:
            raise TimeoutError(f"{what} within {timeout} s")
        time.sleep(0.02)
    return time.monotonic()


def remote_prefills(w: RayWorker, workers: RayWorkers) -> int:
    client = Client(w.address, workers.secret)
    try:
        return client.stats().remote
    finally:
        client.close()


def one_kill(url: str, workers: RayWorkers, w: RayWorker) -> dict[str, float]:
    restarts = workers.supervisor.restarts
    pid = ray.get(w.actor.pid.remote(), timeout=10)
    start = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    down = wait(lambda: not w.alive, 60, f"{w.name} not declared down") - start
    back = wait(lambda: w.alive and workers.supervisor.restarts > restarts, 180, f"{w.name} not back") - start
    decode = workers.decode[0]
    if w.role == "prefill":
        before = remote_prefills(decode, workers)
        while True:  # until a long prompt is prefilled by the restarted worker
            # A new first word each time: a prompt the decode worker has cached is
            # (rightly) prefilled there.
            httpx.post(f"{url}/v1/completions", timeout=60, json={
                "prompt": f"{uuid.uuid4().hex} {LONG_PROMPT}", "max_tokens": 1,
                "temperature": 0.0}).raise_for_status()
            if remote_prefills(decode, workers) > before:
                break
    else:
        while True:  # until the router routes to it again and it answers
            r = httpx.post(f"{url}/v1/completions", timeout=60, json={
                "prompt": "Hello", "max_tokens": 1, "temperature": 0.0})
            if r.status_code == 200 and r.headers.get("x-pdserve-decode-worker") == w.name:
                break
            time.sleep(0.05)
    return {"down": down, "back": back, "served": time.monotonic() - start}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(demo.default_models_dir() / demo.DEMO_MODELS["smollm2"].dir_name))
    parser.add_argument("--kills", type=int, default=3, help="kills per role")
    parser.add_argument("--probe-interval", type=float, default=1.0, help="ray.probe_interval_s")
    parser.add_argument("--probe-timeout", type=float, default=5.0, help="ray.probe_timeout_s")
    args = parser.parse_args()

    config = load_cluster_config(REPO / "configs" / "ray-local.yaml")
    config = dataclasses.replace(
        config, model=args.model,
        ray=dataclasses.replace(config.ray, max_restarts=2 * args.kills, probe_interval_s=args.probe_interval,
                                probe_timeout_s=args.probe_timeout),
        router=dataclasses.replace(config.router, port=free_port(), remote_prefill_min_tokens=32))
    workers, router = build(config)
    http = HTTPServer(router, "127.0.0.1", config.router.port)
    results: dict[str, list[dict[str, float]]] = {"decode": [], "prefill": []}
    try:
        for _ in range(args.kills):
            for role in ("decode", "prefill"):
                w = getattr(workers, role)[0]
                results[role].append(one_kill(http.url, workers, w))
                print(f"{role}: " + ", ".join(f"{k} {v:.2f} s" for k, v in results[role][-1].items()), flush=True)
    finally:
        http.stop()
        workers.stop()
    print(f"\n`{' '.join(sys.argv)}` (probe every {args.probe_interval:g} s, timeout {args.probe_timeout:g} s; "
          f"{args.kills} kills per role)\n")
    print("| worker killed | down | back in service | served a request again |")
    print("|---|---|---|---|")
    for role, runs in results.items():
        cells = []
        for key in ("down", "back", "served"):
            values = [r[key] for r in runs]
            cells.append(f"{statistics.median(values):.2f} s ({min(values):.2f}-{max(values):.2f})")
        print(f"| {role} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
