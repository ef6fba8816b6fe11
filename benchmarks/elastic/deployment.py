"""One arm's deployment: `pdserve serve CONFIG` in a process group of its own, as a user
runs it (so the autoscaled arm's planner starts exactly as it would there), and its
router's admin and metrics endpoints. On exit the whole group is stopped, SIGTERM and
then SIGKILL, and checked gone: the next arm starts only once every worker of this one
has exited."""

from __future__ import annotations

import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx2 as httpx
import psutil
import yaml

REPO_ROOT = Path(__file__).resolve().parent.parent.parent


class DeploymentError(RuntimeError):
    """The deployment did not start or stop as it should: a reason, with its log's tail."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Deployment:
    """`with Deployment(config_dict) as d:` serves at d.url until the block ends.

    config: a cluster config as a dict (its router's port, host and admin key are set
    here); log_dir: where its YAML and its output go; keep_api_keys: serve the config's
    router.api_keys (a list) instead of dropping them, for a load generator that sends
    keys (per-key fair queuing); the readiness probe then uses the first one."""

    def __init__(self, config: dict[str, Any], log_dir: Path, start_timeout_s: float = 300.0,
                 keep_api_keys: bool = False) -> None:
        self.admin_key = secrets.token_hex(16)
        self.port = free_port()
        router = dict(config.get("router") or {})
        keys = router.get("api_keys") if keep_api_keys else None
        if not keep_api_keys:
            router.pop("api_keys", None)  # the load generator sends no key
        self.probe_headers = {"Authorization": f"Bearer {keys[0]}"} if isinstance(keys, list) and keys else {}
        router.update(host="127.0.0.1", port=self.port, admin_keys=[self.admin_key])
        self.config = {**config, "router": router}
        self.root = f"http://127.0.0.1:{self.port}"
        self.url = f"{self.root}/v1"
        self.log_dir = log_dir
        self.start_timeout_s = start_timeout_s
        self.process: subprocess.Popen | None = None

    def __enter__(self) -> Deployment:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        fd, path = tempfile.mkstemp(suffix=".yaml", dir=self.log_dir)  # it holds the admin key: 0600
        with os.fdopen(fd, "w") as f:
            yaml.safe_dump(self.config, f)
        self.log_path = self.log_dir / f"serve-{self.port}.log"
        env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
        with open(self.log_path, "w") as log:
            self.process = subprocess.Popen([sys.executable, "-m", "cluster.cli", "serve", path], cwd=REPO_ROOT,
                                            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            self._await_serving()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _await_serving(self) -> None:
        end = time.monotonic() + self.start_timeout_s
        while True:
            assert self.process is not None
            if self.process.poll() is not None:
                raise DeploymentError(f"pdserve serve exited with {self.process.returncode} before serving\n"
                                      f"{self.log_tail()}")
            try:
                if httpx.get(f"{self.url}/models", timeout=5.0, headers=self.probe_headers).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > end:
                raise DeploymentError(f"pdserve serve did not serve within {self.start_timeout_s:g} s\n"
                                      f"{self.log_tail()}")
            time.sleep(0.25)

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM to the group (pdserve serve stops its workers), SIGKILL to whatever is
        left after timeout_s; DeploymentError if a process of the group survives that."""
        if self.process is None:
            return
        group = self.process.pid  # start_new_session: the group's id is the leader's pid
        members = _group(group)
        _signal_group(group, signal.SIGTERM)
        try:
            self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            pass
        _, alive = psutil.wait_procs(members, timeout=max(0.1, timeout_s / 3))
        if alive or self.process.poll() is None:
            _signal_group(group, signal.SIGKILL)
            self.process.wait(10)
            _, alive = psutil.wait_procs(alive, timeout=10)
        self.process = None
        if alive:
            raise DeploymentError(f"processes {[p.pid for p in alive]} of the deployment outlived SIGKILL")

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def worker_processes(self) -> int:
        """Worker processes alive under pdserve serve, those still loading and those
        draining included: the children of its fork server (cluster/local/fork_server.py),
        which carry the server's command line; not the server itself, nor the resource
        tracker, nor a worker's tensor-parallel followers."""
        if self.process is None:
            return 0
        try:
            children = psutil.Process(self.process.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return 0
        count = 0
        for child in children:
            try:
                forked = any("multiprocessing.forkserver" in part for part in child.cmdline())
                count += forked and child.ppid() != self.process.pid
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                pass
        return count

    def cpu_seconds(self) -> dict[int, float]:
        """User + system CPU seconds so far of pdserve serve and each process under it, by pid."""
        if self.process is None:
            return {}
        out = {}
        try:
            root = psutil.Process(self.process.pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return {}
        for p in procs:
            try:
                t = p.cpu_times()
                out[p.pid] = t.user + t.system
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                pass
        return out

    def admin(self, method: str, path: str, body: dict | None = None, timeout: float = 300.0) -> dict:
        response = httpx.request(method, f"{self.root}{path}", json=body, timeout=timeout,
                                 headers={"Authorization": f"Bearer {self.admin_key}"})
        if response.status_code != 200:
            raise DeploymentError(f"{method} {path} {body or ''}: HTTP {response.status_code}: {response.text[:300]}")
        return response.json()

    def metrics(self) -> str:
        return httpx.get(f"{self.root}/metrics", timeout=30.0).raise_for_status().text


def _group(pgid: int) -> list[psutil.Process]:
    out = []
    for p in psutil.process_iter():
        try:
            if os.getpgid(p.pid) == pgid:
                out.append(p)
        except (ProcessLookupError, psutil.NoSuchProcess):
            pass
    return out


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass
