"""configs/ray-local.yaml run as a Ray job, the way a user runs it on a cluster: the `ray`
CLI starts a head on 127.0.0.1 (`ray start --head`, dashboard on: the job server lives
there), `ray job submit --working-dir <repo> -- pdserve serve configs/ray-local.yaml`
uploads the code and serves the config on that cluster; the endpoint's greedy chat
answer equals the offline engine's, `ray job stop` stops everything the job started
(processes, placement groups, shm segments), and a targeted stop of the head leaves
nothing running.

The head is private to this module: its own temp dir (short, for Ray's unix sockets) and
its own ports. It is never stopped with `ray stop`, which kills every Ray process on
the machine (it matches process names, not a cluster); its processes are found by the
session `ray start` ran in, their children, and the temp dir, and killed like
`ray stop --force` does."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import openai
import psutil
import pytest

from engine import LLM, SamplingParams
from tests.http_server import free_port
from tests.ray.conftest import MODEL_DIR, RAY_ENV, REPO

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]  # as in test_ray_serving.py

# The `ray` and `pdserve` of this venv: not resolved, a venv's python is a symlink.
VENV_BIN = Path(sys.executable).parent
RAY = str(VENV_BIN / "ray")
START_TIMEOUT_S = 90.0  # `ray start --head` (12-17 s here)
SERVE_TIMEOUT_S = 150.0  # submit to /health answering (30-45 s here)
RAY_TOKEN = RAY_ENV["RAY_AUTH_TOKEN"]  # the job server's HTTP API wants it too
UPLOAD_LIMIT_BYTES = 16 << 20  # the code is about 1 MiB; models/, .venv/ are GiBs


@dataclass
class Head:
    temp_dir: Path
    env: dict[str, str]
    gcs_port: int
    dashboard: str  # http://127.0.0.1:<port>, the job server
    sid: int = 0  # the session `ray start` ran in (its daemons inherit it)
    expected: str = ""  # the offline engine's greedy answer to QUESTION
    seen: set[psutil.Process] = field(default_factory=set)  # everything of the head's ever observed

    def cli(self, *args: str, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
        return subprocess.run([RAY, *args], env=self.env, cwd=REPO, capture_output=True, text=True,
                              timeout=timeout, check=False)

    def processes(self) -> set[psutil.Process]:
        """Live processes of this head: `ray start`'s session (GCS, raylet, dashboard,
        agents, workers, actors), anything whose command line or working directory is in
        its temp dir (the job's entrypoint runs in the unpacked working dir, in a session
        of its own), and their children."""
        own = {os.getpid(), *(p.pid for p in psutil.Process().parents())}
        marker = str(self.temp_dir)
        roots = set()
        for proc in psutil.process_iter(["cmdline"]):
            if proc.pid in own:
                continue
            try:
                if (os.getsid(proc.pid) == self.sid or marker in " ".join(proc.info["cmdline"] or ())
                        or proc.cwd().startswith(marker)):
                    roots.add(proc)
            except (psutil.Error, OSError):
                continue
        found = set(roots)
        for proc in roots:
            try:
                found |= set(proc.children(recursive=True))
            except psutil.Error:
                continue
        live = {p for p in found if _alive(p) and p.pid not in own}
        self.seen |= live
        return live

    def job(self, submission_id: str) -> dict:
        return json.loads(_get(f"{self.dashboard}/api/jobs/{submission_id}", token=RAY_TOKEN))

    def placement_groups(self) -> dict[str, str]:
        """Every placement group the cluster knows, by name: its state (Ray's state API)."""
        reply = json.loads(_get(f"{self.dashboard}/api/v0/placement_groups?limit=1000", token=RAY_TOKEN))
        return {pg["name"] or pg["placement_group_id"]: pg["state"] for pg in reply["data"]["result"]["result"]}

    def job_logs(self, submission_id: str) -> str:
        try:
            return json.loads(_get(f"{self.dashboard}/api/jobs/{submission_id}/logs", token=RAY_TOKEN))["logs"]
        except (OSError, ValueError, KeyError) as exc:
            return f"(no job logs: {exc})"

    def kill(self, timeout: float = 20.0) -> None:
        """`ray stop --force`, for this head only: SIGKILL until nothing of it is left
        (the dashboard restarts a module process that dies under it, so scan again)."""
        end = time.monotonic() + timeout
        while (procs := self.processes()) and time.monotonic() < end:
            for proc in procs:
                try:
                    proc.send_signal(signal.SIGKILL)
                except psutil.Error:
                    pass
            psutil.wait_procs(list(procs), timeout=2)


def _alive(proc: psutil.Process) -> bool:
    try:  # a zombie holds nothing; PID 1 reaps orphans when it gets to it
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _title(proc: psutil.Process) -> str:
    try:
        return " ".join(proc.cmdline())
    except psutil.Error:
        return ""


def _cwd(proc: psutil.Process) -> str:
    try:
        return proc.cwd()
    except psutil.Error:
        return ""


def _get(url: str, timeout: float = 5.0, token: str | None = None) -> str:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return response.read().decode()


def _port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1.0)
        return s.connect_ex(("127.0.0.1", port)) == 0


def _upload_excludes() -> list[str]:
    # Ray honours .gitignore files (models/, results/, .venv/) and leaves out .git and
    # .venv by default, but not .git/info/exclude: forward its patterns too.
    excludes = ["/.git", "/.venv", "/models", "/results"]
    info = REPO / ".git" / "info" / "exclude"
    if info.is_file():
        excludes += [line.strip() for line in info.read_text().splitlines()
                     if line.strip() and not line.startswith("#")]
    return excludes


def _offline_answer() -> str:
    llm = LLM(str(MODEL_DIR), dtype="float32", device="cpu", num_threads=1, num_kv_blocks=64)
    return llm.chat([QUESTION], SamplingParams(max_tokens=12, temperature=0.0), use_tqdm=False)[0].text


def _head_command(head: Head, ports: dict[str, int]) -> list[str]:
    return [RAY, "start", "--head", "--node-ip-address=127.0.0.1", f"--port={head.gcs_port}",
            "--include-dashboard=true", "--dashboard-host=127.0.0.1", f"--dashboard-port={ports['dashboard']}",
            "--num-cpus=2",  # one per worker actor (ray.prefill/decode.num_cpus); the job's driver takes none
            f"--object-store-memory={256 << 20}", f"--temp-dir={head.temp_dir}", "--disable-usage-stats",
            # Every port of its own, so that no other Ray on the machine is in the way.
            f"--ray-client-server-port={ports['client']}",
            f"--dashboard-agent-listen-port={ports['agent_http']}",
            f"--dashboard-agent-grpc-port={ports['agent_grpc']}", f"--metrics-export-port={ports['metrics']}",
            f"--runtime-env-agent-port={ports['runtime_env']}", f"--node-manager-port={ports['node_manager']}",
            f"--object-manager-port={ports['object_manager']}", "--log-style=record"]


@pytest.fixture(scope="module")
def head() -> Iterator[Head]:
    if not (MODEL_DIR / "model.safetensors").is_file():
        pytest.skip(f"demo model not prepared at {MODEL_DIR} (make model)")
    # Short: Ray's sockets go to <temp>/session_<date>_<pid>/sockets/plasma_store, and a
    # unix socket path holds at most 107 bytes (pytest's tmp_path is too long for it).
    temp_dir = Path(tempfile.mkdtemp(prefix="pdserve-rayjob-", dir="/tmp"))
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS")}
    env.update(RAY_ENV)
    # An activated venv: the job's entrypoint finds `pdserve` (and `python`) on the PATH
    # the cluster was started with; without it the entrypoint fails with exit code 127.
    env.update(PATH=f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}", VIRTUAL_ENV=str(VENV_BIN.parent),
               RAY_USAGE_STATS_ENABLED="0",
               # `ray job stop` SIGKILLs the entrypoint 3 s after its SIGTERM by default.
               # pdserve's orderly stop (actors, placement groups, shm segments) took
               # about 2 s here (its bound: cluster/ray/deployment.SHUTDOWN_S), and the interpreter's exit 2-3 s more.
               RAY_JOB_STOP_WAIT_TIME_S="60")
    ports = {name: free_port() for name in ("gcs", "dashboard", "client", "agent_http", "agent_grpc", "metrics",
                                            "runtime_env", "node_manager", "object_manager")}
    head = Head(temp_dir, env, ports["gcs"], f"http://127.0.0.1:{ports['dashboard']}")
    log = temp_dir / "ray-start.log"
    try:
        with open(log, "w") as out:
            start = subprocess.Popen(_head_command(head, ports), env=env, cwd=REPO, stdout=out,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        head.sid = start.pid
        head.expected = _offline_answer()  # meanwhile: `ray start` waits for its daemons a lot
        try:
            rc = start.wait(START_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            rc = None
        assert rc == 0, f"`ray start --head` {'timed out' if rc is None else f'exited {rc}'}:\n{log.read_text()}"
        head.processes()
        yield head
    finally:
        head.kill()
        left = head.processes() | {p for p in head.seen if _alive(p)}
        shutil.rmtree(temp_dir, ignore_errors=True)
        assert not left, f"the Ray head left processes behind: {left}"
        assert not _port_open(head.gcs_port) and not _port_open(ports["dashboard"])


@dataclass
class Job:
    submission_id: str
    port: int  # the router's
    package: str = ""  # where the head unpacked the uploaded working dir
    segments: set[str] = field(default_factory=set)  # the workers' shm KV segments (/dev/shm)


@pytest.fixture(scope="module")
def job(head: Head) -> Iterator[Job]:
    """The submitted job, once its router's /health answers."""
    submission_id, port = f"pdserve-test-{uuid.uuid4().hex[:8]}", free_port()
    submit = head.cli("job", "submit", f"--address={head.dashboard}", f"--submission-id={submission_id}",
                      f"--working-dir={REPO}", "--runtime-env-json", json.dumps({"excludes": _upload_excludes()}),
                      "--no-wait", "--log-style=record",
                      "--", "pdserve", "serve", "configs/ray-local.yaml", "--model", str(MODEL_DIR),
                      "--port", str(port))
    assert submit.returncode == 0, f"ray job submit failed:\n{submit.stdout}{submit.stderr}"
    try:
        end = time.monotonic() + SERVE_TIMEOUT_S
        while True:
            try:
                _get(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except (OSError, urllib.error.URLError):
                pass
            try:
                status = head.job(submission_id)["status"]
            except (OSError, ValueError):  # a busy dashboard: ask again
                status = "PENDING"
            assert status in ("PENDING", "RUNNING"), (
                f"the job ended ({status}) before serving:\n{head.job_logs(submission_id)}")
            assert time.monotonic() < end, (
                f"no /health on port {port} within {SERVE_TIMEOUT_S:g} s:\n{head.job_logs(submission_id)}")
            time.sleep(0.5)
        # The entrypoint, its actors and Ray's job watcher, while they run; and the shm
        # segments the actors mapped (pdserve's stop removes them).
        unpacked = head.temp_dir / "session_latest" / "runtime_resources" / "working_dir_files"
        (package,) = [str(p.resolve()) for p in unpacked.glob("_ray_pkg_*") if p.is_dir()]
        actors = [p for p in head.processes() if _title(p).startswith("ray::WorkerActor")]
        segments = {m.path for p in actors for m in p.memory_maps() if m.path.startswith("/dev/shm/pdserve-kv-")}
        yield Job(submission_id, port, package, segments)
    finally:
        try:
            if head.job(submission_id)["status"] in ("PENDING", "RUNNING"):
                head.cli("job", "stop", f"--address={head.dashboard}", submission_id, timeout=60)
        except (OSError, ValueError, subprocess.TimeoutExpired):
            pass  # the head's teardown kills what is left


@pytest.mark.timeout(330)  # includes the head's start and the job's (about 50 s here)
def test_submitted_job_serves_the_offline_engines_greedy_answer(head: Head, job: Job) -> None:
    submission_id, port = job.submission_id, job.port
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", timeout=60, max_retries=0)
    chat = client.chat.completions.create(model=str(MODEL_DIR), messages=QUESTION, max_tokens=12, temperature=0.0)
    assert chat.choices[0].message.content == head.expected == "The capital of France is Paris."
    # The driver ran the uploaded code (Ray's working dir, first on PYTHONPATH), and the
    # upload left out models/, .venv/ and .git/.
    driver = psutil.Process(int(head.job(submission_id)["driver_info"]["pid"]))
    assert driver.cwd() == job.package
    package = Path(job.package)
    assert (package / "configs" / "ray-local.yaml").is_file()
    assert not any((package / name).exists() for name in (".git", ".venv", "models", "results"))
    size = sum(f.stat().st_size for f in package.rglob("*") if f.is_file())
    assert size < UPLOAD_LIMIT_BYTES, f"the working-dir upload holds {size / 2**20:.1f} MiB"


@pytest.mark.timeout(60)
def test_the_cluster_refuses_clients_without_its_token(head: Head, job: Job) -> None:
    """Token auth is on (Ray's default): the job server and the CLI without the token
    are refused, so nobody else on the network submits code to this cluster."""
    with pytest.raises(urllib.error.HTTPError) as refused:
        _get(f"{head.dashboard}/api/jobs/{job.submission_id}")
    assert refused.value.code == 401
    with pytest.raises(urllib.error.HTTPError) as refused:
        _get(f"{head.dashboard}/api/jobs/{job.submission_id}", token="not-" + RAY_TOKEN[4:])
    assert refused.value.code in (401, 403)
    env = {k: v for k, v in head.env.items() if k != "RAY_AUTH_TOKEN"}
    listing = subprocess.run([RAY, "job", "list", f"--address={head.dashboard}"], env=env, cwd=REPO,
                             capture_output=True, text=True, timeout=60, check=False)
    assert listing.returncode != 0, listing.stdout
    assert head.job(job.submission_id)["status"] == "RUNNING"  # with the token: served


@pytest.mark.timeout(120)  # includes stopping the head (module teardown)
def test_job_stop_stops_the_router_and_its_workers(head: Head, job: Job) -> None:
    submission_id, port = job.submission_id, job.port
    driver = int(head.job(submission_id)["driver_info"]["pid"])
    groups = head.placement_groups()  # the job's (one per pool)
    assert groups and set(groups.values()) == {"CREATED"}
    stop = head.cli("job", "stop", f"--address={head.dashboard}", "--log-style=record", submission_id)
    assert stop.returncode == 0, f"ray job stop failed:\n{stop.stdout}{stop.stderr}"
    assert head.job(submission_id)["status"] == "STOPPED"
    logs = head.job_logs(submission_id)
    assert "pdserve: stopped" in logs, f"pdserve did not stop in order (SIGKILLed?):\n{logs}"
    assert not _port_open(port)
    assert set(head.placement_groups().values()) == {"REMOVED"}
    assert job.segments, "found no shm KV segment mapped by a ray::WorkerActor process"
    assert not any(os.path.exists(path) for path in job.segments)
    # Nothing runs in the job's working dir any more (the entrypoint, the actors, Ray's
    # job supervisor); Ray's own processes stay.
    end = time.monotonic() + 15
    while (left := [p for p in head.processes() if p.pid == driver or _cwd(p) == job.package]) \
            and time.monotonic() < end:
        time.sleep(0.2)
    assert not left, f"the job's processes outlived `ray job stop`: {[_title(p) for p in left]}"


def _pdserve(head: Head, *args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    """The `pdserve` CLI as a user runs it against the head: RAY_ADDRESS makes
    ray-local.yaml's `address: local` join that cluster (as inside a job)."""
    env = dict(head.env, RAY_ADDRESS=f"127.0.0.1:{head.gcs_port}")
    return subprocess.run([str(VENV_BIN / "pdserve"), *args], env=env, cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, check=False)


@pytest.mark.timeout(300)  # after the job tests: their actors are gone, the head's 2 CPUs free
def test_a_detached_deployment_outlives_its_command_until_pdserve_down(head: Head, job: Job) -> None:
    port = free_port()
    serve_args = ("serve", "configs/ray-local.yaml", "--detach", "--model", str(MODEL_DIR), "--port", str(port))
    started = _pdserve(head, *serve_args, timeout=SERVE_TIMEOUT_S + 30)
    assert started.returncode == 0, f"pdserve serve --detach failed:\n{started.stdout}{started.stderr}"
    assert f"at http://127.0.0.1:{port}/v1" in started.stdout and "detached" in started.stdout
    try:
        # The command has returned; the deployment serves on.
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", timeout=60, max_retries=0)
        chat = client.chat.completions.create(model=str(MODEL_DIR), messages=QUESTION, max_tokens=12,
                                              temperature=0.0)
        assert chat.choices[0].message.content == head.expected
        status = json.loads(_get(f"http://127.0.0.1:{port}/status"))
        assert [(w["name"], w["live"]) for w in status["decode_workers"] + status["prefill_workers"]] == [
            ("decode-0", True), ("prefill-0", True)]
        again = _pdserve(head, *serve_args, timeout=60)  # the name is taken: refused, nothing started
        assert again.returncode == 2 and "a deployment named 'pdserve' already runs" in again.stderr
    finally:
        down = _pdserve(head, "down", "configs/ray-local.yaml", timeout=90)
    assert down.returncode == 0, f"pdserve down failed:\n{down.stdout}{down.stderr}"
    assert f"stopped the deployment 'pdserve' that served http://127.0.0.1:{port}" in down.stdout
    assert not _port_open(port)
    end = time.monotonic() + 15
    while not set(head.placement_groups().values()) <= {"REMOVED"}:
        assert time.monotonic() < end, f"placement groups outlived `pdserve down`: {head.placement_groups()}"
        time.sleep(0.2)
    end = time.monotonic() + 15
    while (left := [_title(p) for p in head.processes() if _title(p).startswith(("ray::WorkerActor",
                                                                                 "ray::DeploymentActor"))]) \
            and time.monotonic() < end:
        time.sleep(0.2)
    assert not left, f"actors outlived `pdserve down`: {left}"
    gone = _pdserve(head, "down", "configs/ray-local.yaml", timeout=60)
    assert gone.returncode == 1 and "no pdserve deployment named 'pdserve'" in gone.stderr
