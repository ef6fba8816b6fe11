"""benchmarks/serving/slo.py's deployments: each arm's cluster config (a topology, an
SLO policy, API keys and their weights) built from one base config, and what the
benchmark asks of a running one (warm-up, capacity, unloaded latency, drain, /status)."""

from __future__ import annotations

import asyncio
import json
import re
import time
from pathlib import Path
from typing import Any

import httpx2 as httpx
import yaml

from benchmarks.elastic.deployment import Deployment
from benchmarks.serving.load import Workload, auth_headers
from benchmarks.serving.slo_load import NO_SLO, Sent, Unloaded, draw_trace, run_closed_loop, steady_rate

TOPOLOGY = re.compile(r"^(\d+)p(\d+)d$")
DRAIN_TIMEOUT_S = 600.0  # a fcfs run at 3x capacity may leave minutes of backlog behind


def parse_topology(name: str) -> tuple[int, int]:
    """'1p2d' -> (1, 2): prefill and decode replicas."""
    match = TOPOLOGY.match(name)
    if not match or int(match[2]) < 1:
        raise ValueError(f"topology {name!r} is not NpMd with M >= 1 (e.g. 1p1d, 1p2d)")
    return int(match[1]), int(match[2])


def arm_config(base: dict[str, Any], topology: str, policy: str, remote_min: int,
               api_keys: list[str] | None = None, key_weights: list[float] | None = None) -> dict[str, Any]:
    """The base config served as `topology`, with router.slo.policy `policy` (no default
    targets: each request carries its own), every prompt of at least `remote_min` tokens
    prefilled remotely, prefix caching off, and, if given, API keys with fair-queuing
    weights."""
    prefill, decode = parse_topology(topology)
    router = {**(base.get("router") or {}), "remote_prefill_min_tokens": remote_min, "slo": {"policy": policy}}
    router.pop("key_weights", None)
    router.pop("api_keys", None)
    if api_keys:
        router["api_keys"] = list(api_keys)
    if key_weights:
        router["key_weights"] = list(key_weights)
    # Prefix caching off: a seed's trace recurs across loads (and the quiet key's across
    # the noisy neighbour's phases), and a later run must not find its prompts cached.
    pools = {}
    for role, replicas in (("prefill", prefill), ("decode", decode)):
        pool = dict(base.get(role) or {})
        pools[role] = {**pool, "replicas": replicas,
                       "engine": {**(pool.get("engine") or {}), "enable_prefix_caching": False}}
    return {**base, "router": router, **pools}


def load_base(path: Path) -> dict[str, Any]:
    return yaml.safe_load(path.read_text())


def token_range(base: dict[str, Any]) -> tuple[int, int]:
    """Prompt token ids to draw from: clear of the special ids at the bottom, below the
    model's vocabulary (read from its config.json, so a tiny test model works too)."""
    vocab = json.loads((Path(base["model"]) / "config.json").read_text())["vocab_size"]
    low = min(100, vocab // 4)
    return low, min(30000, vocab)


class Live:
    """A running deployment as the benchmark uses it; api_key: the key its /status asks
    for where router.api_keys is set (only /health is open then)."""

    def __init__(self, deployment: Deployment, model: str, workload: Workload, api_key: str | None = None) -> None:
        self.d = deployment
        self.model = model
        self.workload = workload
        self.api_key = api_key

    def closed_loop(self, concurrency: int, seconds: float, seed: int, api_key: str | None = None) -> list[Sent]:
        n = concurrency + int(seconds * 50) + 16  # more than a CPU deployment serves in `seconds`
        trace = draw_trace(self.workload, seed, None, None, [NO_SLO], n=n)
        return asyncio.run(run_closed_loop(self.d.url, self.model, trace, concurrency, seconds, api_key))

    def warm_up(self, concurrency: int, seconds: float, api_key: str | None = None) -> None:
        """Requests one at a time, then a closed loop: every worker's first steps are
        slow, and the slo arm's predictor learns step times at batch sizes from these."""
        self.closed_loop(1, min(seconds, 5.0), seed=9001, api_key=api_key)
        self.closed_loop(concurrency, seconds, seed=9002, api_key=api_key)
        self.drain()

    def capacity(self, concurrency: int, seconds: float, api_key: str | None = None) -> float:
        """Completed requests per second with `concurrency` outstanding (saturated)."""
        sent = self.closed_loop(concurrency, seconds, seed=9003, api_key=api_key)
        self.drain()
        rate = steady_rate(sent, seconds)
        if rate <= 0:
            errors = sorted({s.result.error for s in sent if s.result.error})[:3]
            raise RuntimeError(f"no request completed in the capacity window: {errors}")
        return rate

    def unloaded(self, requests: int, api_key: str | None = None) -> Unloaded:
        """p50 TTFT and TPOT of `requests` sent one at a time."""
        trace = draw_trace(self.workload, 9004, None, None, [NO_SLO], n=requests)
        sent = asyncio.run(run_closed_loop(self.d.url, self.model, trace, 1, float("inf"), api_key))
        self.drain()
        return Unloaded.of(sent)

    def status(self, prediction_window: int | None = None) -> dict[str, Any]:
        """/status; `prediction_window`: its SLO prediction error over that many of the
        latest predictions (a run's own), at most the router's 1000."""
        params = {"prediction_window": str(min(1000, prediction_window))} if prediction_window else None
        return httpx.get(f"{self.d.root}/status", timeout=30.0, headers=auth_headers(self.api_key),
                         params=params).raise_for_status().json()

    def drain(self, idle_s: float = 0.0) -> None:
        """Until the router has nothing in flight (the client has its answers, but a
        cancelled stream may still hold a slot), then `idle_s` more."""
        end = time.monotonic() + DRAIN_TIMEOUT_S
        while self.status().get("in_flight", 0) > 0:
            if time.monotonic() > end:
                raise RuntimeError(f"requests still in flight after {DRAIN_TIMEOUT_S:g} s")
            time.sleep(0.5)
        time.sleep(idle_s)
