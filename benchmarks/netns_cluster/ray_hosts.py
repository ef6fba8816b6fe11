"""A Ray cluster across the bed's hosts: `ray start --head` on one host, `ray start
--address` on the others, each at its host's address and with its own temp dir (its
logs and sockets, removed with the bed), and `ray job submit` to the head's job server.

Every Ray process runs in its host's namespace, so `NetnsCluster.down` (or
`kill_host`) ends it: no `ray stop`, which kills every Ray process of the machine.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path

from benchmarks.netns_cluster.bed import NetnsCluster

GCS_PORT = 6379
DASHBOARD_PORT = 8265
VENV_BIN = Path(sys.executable).parent


def ray_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment Ray's processes and CLI run in: this venv first on the PATH (a
    job's entrypoint finds `pdserve`), token auth off (the bed's hosts are private, and
    no host outside the bed can reach them), no usage reports."""
    env = dict(os.environ)
    env.update(PATH=f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}", VIRTUAL_ENV=str(VENV_BIN.parent),
               RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0")
    env.pop("RAY_ADDRESS", None)
    # =0 (the single-machine tests' setting) makes `ray start --address` refuse to join
    env.pop("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", None)
    env.update(extra or {})
    return env


class RayHosts:
    def __init__(self, bed: NetnsCluster, head: int, env: Mapping[str, str] | None = None) -> None:
        self.bed, self.head = bed, head
        self.env = ray_env(env)

    @property
    def gcs(self) -> str:
        return f"{self.bed.address(self.head)}:{GCS_PORT}"

    @property
    def dashboard(self) -> str:
        return f"http://{self.bed.address(self.head)}:{DASHBOARD_PORT}"

    def start_head(self, resources: Mapping[str, float] | None = None, num_cpus: int = 1) -> None:
        self._ray(self.head, "start", "--head", f"--port={GCS_PORT}", "--include-dashboard=true",
                  f"--dashboard-host={self.bed.address(self.head)}", f"--dashboard-port={DASHBOARD_PORT}",
                  *self._node_args(self.head, resources, num_cpus))

    def join(self, host: int, resources: Mapping[str, float] | None = None, num_cpus: int = 1) -> None:
        self._ray(host, "start", f"--address={self.gcs}", *self._node_args(host, resources, num_cpus))

    def cli(self, *args: str, timeout: float = 120.0) -> subprocess.CompletedProcess:
        """The `ray` CLI, run on the head (where a user submits jobs from)."""
        return self.bed.run(self.head, [str(VENV_BIN / "ray"), *args], timeout=timeout, env=self.env)

    def submit(self, submission_id: str, entrypoint: Sequence[str], working_dir: Path,
               runtime_env: Mapping[str, object]) -> None:
        done = self.cli("job", "submit", f"--address={self.dashboard}", f"--submission-id={submission_id}",
                        f"--working-dir={working_dir}", "--runtime-env-json", json.dumps(dict(runtime_env)),
                        "--no-wait", "--log-style=record", "--", *entrypoint)
        if done.returncode != 0:
            raise RuntimeError(f"ray job submit failed:\n{done.stdout}{done.stderr}")

    def job_status(self, submission_id: str) -> str:
        """PENDING, RUNNING, SUCCEEDED, FAILED or STOPPED: the job server's REST answer."""
        for attempt in range(3):  # a dashboard busy on a loaded machine: ask again
            try:
                with self.bed.inside(self.head):
                    with urllib.request.urlopen(f"{self.dashboard}/api/jobs/{submission_id}", timeout=10) as r:
                        return str(json.loads(r.read())["status"])
            except OSError:
                if attempt == 2:
                    raise
                time.sleep(2)
        raise AssertionError("unreachable")

    def job_logs(self, submission_id: str) -> str:
        return self.cli("job", "logs", f"--address={self.dashboard}", submission_id).stdout

    def stop_job(self, submission_id: str, timeout: float = 60.0) -> None:
        self.cli("job", "stop", f"--address={self.dashboard}", submission_id, timeout=timeout)

    def _node_args(self, host: int, resources: Mapping[str, float] | None, num_cpus: int) -> list[str]:
        return [f"--node-ip-address={self.bed.address(host)}", f"--num-cpus={num_cpus}",
                f"--resources={json.dumps(dict(resources or {}))}", f"--temp-dir={self.bed.host_dir(host)}",
                "--object-store-memory=100000000", "--disable-usage-stats"]

    def _ray(self, host: int, *args: str) -> None:
        start = time.monotonic()
        done = self.bed.run(host, [str(VENV_BIN / "ray"), *args], timeout=120, env=self.env)
        if done.returncode != 0:
            raise RuntimeError(f"`ray {' '.join(args)}` on host {host} failed after "
                               f"{time.monotonic() - start:.0f} s:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
