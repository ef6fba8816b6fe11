"""The deployment a chaos run attacks (benchmarks/chaos/run.py): `pdserve serve CONFIG` as a
child process, what its router's /status says over time, and the resident memory of
the router and worker processes.

Every process the run starts is a descendant of the `pdserve serve` process and in
the caller's process group (no new session), so whoever runs the harness can end all
of it with one killpg; `Deployment.stop` ends it gracefully (SIGINT), then by pid.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def auth_headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def get_json(port: int, path: str, api_key: str | None, timeout: float = 10.0) -> tuple[int, Any]:
    """(status, parsed body) of GET path on the router; raises OSError when it cannot be reached."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("GET", path, headers=auth_headers(api_key))
        response = conn.getresponse()
        body = response.read()
        try:
            return response.status, json.loads(body)
        except ValueError:
            return response.status, None
    finally:
        conn.close()


def children(pid: int) -> list[int]:
    """Every live descendant of pid (from /proc), so none outlives a run."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            parents[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
    found, frontier = [], [pid]
    while frontier:
        kids = [p for p, parent in parents.items() if parent in frontier]
        found += kids
        frontier = kids
    return found


def rss_kib(pid: int) -> tuple[int, int] | None:
    """(VmRSS, VmRSS less RssShmem) in KiB. Shared memory is a decode worker's KV cache
    (the shm transport maps it from /dev/shm): it grows as blocks are first written, up
    to the pool's size, and is no leak; the rest is the process's own."""
    try:
        fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
        rss, shmem = int(fields["VmRSS"].split()[0]), int(fields["RssShmem"].split()[0])
    except (OSError, KeyError, ValueError):
        return None
    return rss, rss - shmem


@dataclass
class Sample:
    """One /status reading: per worker (both pools), live as the router sees it, and the
    pid of its rank 0 when it answered."""

    t: float
    live: dict[str, bool]
    pids: dict[str, int | None]
    stats: dict[str, dict | None]
    addresses: dict[str, str]
    in_flight: int | None


@dataclass
class Deployment:
    config: str
    port: int
    log_path: Path
    api_key: str | None = None
    model: str | None = None  # pdserve serve --model (the config's otherwise)
    proc: subprocess.Popen | None = None
    samples: list[Sample] = field(default_factory=list)
    # (t, name, pid, VmRSS KiB, VmRSS less shared memory KiB)
    rss: list[tuple[float, str, int, int, int]] = field(default_factory=list)
    stopped: set[int] = field(default_factory=set)  # pids under SIGSTOP (SIGCONT before stopping)
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)

    def start(self, timeout: float = 180.0) -> None:
        """Start `pdserve serve` and wait until every worker of both pools is live."""
        cmd = [sys.executable, "-c", "import sys; from cluster.cli import main; sys.exit(main())", "serve",
               self.config, "--port", str(self.port), *(["--model", self.model] if self.model else [])]
        log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=log,
                                     stderr=subprocess.STDOUT)
        log.close()
        end = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"pdserve serve exited with {self.proc.returncode}:\n{self.log_tail()}")
            sample = self.sample()
            if sample is not None and sample.live and all(sample.live.values()) and all(sample.pids.values()):
                return
            if time.monotonic() > end:
                raise RuntimeError(f"pdserve serve did not serve within {timeout:g} s:\n{self.log_tail()}")
            time.sleep(0.5)

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def sample(self) -> Sample | None:
        """Read /status now (None while the router does not answer)."""
        try:
            status, body = get_json(self.port, "/status", self.api_key)
        except OSError:
            return None
        if status != 200 or not isinstance(body, dict):
            return None
        rows = body.get("decode_workers", []) + body.get("prefill_workers", [])
        stats = {r["name"]: r.get("stats") for r in rows}
        pids = {n: (s.get("ranks") or [None])[0] if s else None for n, s in stats.items()}
        return Sample(time.monotonic(), {r["name"]: bool(r["live"]) for r in rows}, pids, stats,
                      {r["name"]: r.get("address", "") for r in rows}, body.get("in_flight"))

    @property
    def latest(self) -> Sample:
        return self.samples[-1]

    def watch(self, status_interval_s: float, rss_interval_s: float) -> None:
        """Sample /status and the processes' VmRSS from threads, until stop()."""
        def status_loop() -> None:
            while not self._stop.wait(status_interval_s):
                sample = self.sample()
                if sample is not None:
                    self.samples.append(sample)

        def rss_loop() -> None:
            procs = {"router": self.proc.pid}  # the last pid /status gave each worker
            while not self._stop.wait(rss_interval_s):
                now = time.monotonic()
                if self.samples:
                    procs |= {n: p for n, p in self.latest.pids.items() if p}
                for name, pid in procs.items():
                    kib = rss_kib(pid)
                    if kib is not None and pid not in self.stopped:
                        self.rss.append((now, name, pid, *kib))

        first = self.sample()
        if first is not None:
            self.samples.append(first)
        self._threads = [threading.Thread(target=f, daemon=True) for f in (status_loop, rss_loop)]
        for t in self._threads:
            t.start()

    def is_worker(self, pid: int) -> bool:
        """Only our own workers are ever signalled."""
        return self.proc is not None and pid in children(self.proc.pid)

    def signal(self, pid: int, sig: signal.Signals) -> bool:
        if not self.is_worker(pid):
            return False
        if sig == signal.SIGSTOP:
            self.stopped.add(pid)
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            return False
        finally:
            if sig in (signal.SIGCONT, signal.SIGKILL):
                self.stopped.discard(pid)
        return True

    def stop(self, timeout: float = 60.0) -> int | None:
        """Resume what is stopped, SIGINT `pdserve serve`, then SIGKILL anything left. Its exit status."""
        self._stop.set()
        for t in self._threads:
            t.join(5)
        if self.proc is None:
            return None
        for pid in list(self.stopped):
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        self.stopped.clear()
        descendants = children(self.proc.pid)
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for pid in descendants + children(self.proc.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return self.proc.returncode
