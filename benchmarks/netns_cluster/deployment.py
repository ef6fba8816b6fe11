"""A pdserve deployment on the bed's hosts, as its tests and benchmarks reach it: `ray job
submit` of a config, then HTTP to the router from inside the router's host (the bed's
addresses are reached from inside the bed only)."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from benchmarks.netns_cluster.bed import NetnsCluster
from benchmarks.netns_cluster.ray_hosts import RayHosts

REPO = Path(__file__).resolve().parents[2]  # the working dir a job uploads
MODEL = REPO / "models" / "SmolLM2-135M-Instruct"
KEY = "sk-multihost"
RUNTIME_ENV: dict[str, Any] = {"excludes": ["/.git", "/.venv", "/models", "/results"],
                               "env_vars": {"PDSERVE_API_KEYS": KEY}}
# UCX on the bed: its hosts share one kernel, so UCX would take them for one machine and
# move KV through shared memory, never over the link (real hosts without RDMA get TCP).
UCX_ACROSS_THE_BED = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "eth0"}
SERVE_TIMEOUT_S = 240.0


class Deployment:
    def __init__(self, bed: NetnsCluster, ray: RayHosts, router_host: int, job: str = "serve") -> None:
        self.bed, self.ray, self.router_host, self.job = bed, ray, router_host, job

    def submit(self, config: Path | str, env: Mapping[str, str] | None = None) -> Deployment:
        """`ray job submit` of config (with `env` for every process of the job) and wait
        until the router serves."""
        runtime_env = {**RUNTIME_ENV, "env_vars": {**RUNTIME_ENV["env_vars"], **(env or {})}}
        self.ray.submit(self.job, ["pdserve", "serve", str(config), "--model", str(MODEL)], REPO, runtime_env)
        self.wait_serving()
        return self

    def stop(self) -> None:
        if self.ray.job_status(self.job) in ("PENDING", "RUNNING"):
            self.ray.stop_job(self.job)

    def call(self, path: str, body: dict | None = None, timeout: float = 60.0) -> Any:
        with self.bed.inside(self.router_host):
            with urllib.request.urlopen(self._request(path, body), timeout=timeout) as r:
                return json.loads(r.read())

    def stream(self, body: dict, on_event: Callable[[int], None] | None = None,
               timeout: float = 120.0) -> tuple[str, list[dict], float]:
        """A streamed completion: its text, its events, and the seconds to its first
        token. `on_event(i)` runs after the i-th event (1 first)."""
        start = time.monotonic()
        with self.bed.inside(self.router_host):
            response = urllib.request.urlopen(self._request("/v1/completions", {**body, "stream": True}),
                                              timeout=timeout)
        text, events, first = "", [], float("nan")
        with response:
            for line in _sse_data(response):
                event = json.loads(line)
                events.append(event)
                if event.get("choices"):
                    if not text:
                        first = time.monotonic() - start
                    text += event["choices"][0].get("text", "")
                if on_event is not None:
                    on_event(len(events))
        return text, events, first

    def workers(self) -> dict[str, dict]:
        """/status's rows of both pools by name: address, live, draining, stats. A row's
        stats are null unless the worker answered this ask: /status shows a busy worker's
        older figures (stats_age_s > 0), which a test would read as its counters now."""
        status = self.call("/status", timeout=30)
        rows = {w["name"]: w for w in status["decode_workers"] + status["prefill_workers"]}
        for row in rows.values():
            if row.get("stats_age_s") != 0:
                row["stats"] = None
        return rows

    def stats(self, timeout: float = 60.0) -> dict[str, dict]:
        """Every worker's stats by name, once each has answered one ask of /status (a
        worker in a long step may miss one: its row's stats are then null)."""
        workers = self.wait("every worker's stats", lambda w: all(row["stats"] for row in w.values()), timeout)
        return {name: row["stats"] for name, row in workers.items()}

    def host_of(self, row: dict) -> int:
        """The bed host a /status row's worker listens on."""
        address = row["address"].removeprefix("tcp://").rsplit(":", 1)[0]
        return [h for h in range(1, self.bed.hosts + 1) if self.bed.address(h) == address][0]

    def wait(self, what: str, done: Callable[[dict[str, dict]], bool], timeout: float = 120.0) -> dict[str, dict]:
        """Poll /status until done(workers) holds (a row without stats, a worker that
        missed the router's last ask, is a "not yet": TypeError or KeyError in done)."""
        end = time.monotonic() + timeout
        workers: dict[str, dict] = {}
        while True:
            try:
                workers = self.workers()
                if done(workers):
                    return workers
            except (OSError, urllib.error.URLError, TypeError, KeyError):
                pass
            assert time.monotonic() < end, f"not within {timeout:g} s: {what}; last /status: {workers}"
            time.sleep(1)

    def wait_serving(self) -> None:
        end = time.monotonic() + SERVE_TIMEOUT_S
        while True:
            try:
                self.call("/health", timeout=2)
                return
            except (OSError, urllib.error.URLError):
                pass
            status = self.ray.job_status(self.job)
            assert status in ("PENDING", "RUNNING"), \
                f"the job ended ({status}) before serving:\n{self.ray.job_logs(self.job)}"
            assert time.monotonic() < end, f"no /health within {SERVE_TIMEOUT_S:g} s:\n{self.ray.job_logs(self.job)}"
            time.sleep(1)

    def _request(self, path: str, body: dict | None) -> urllib.request.Request:
        data = None if body is None else json.dumps(body).encode()
        return urllib.request.Request(f"http://{self.bed.address(self.router_host)}:8000{path}", data=data, headers={
            "Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})


def _sse_data(response: Any) -> Iterator[str]:
    for raw in response:
        line = raw.decode().strip()
        if line.startswith("data: ") and line != "data: [DONE]":
            yield line.removeprefix("data: ")
