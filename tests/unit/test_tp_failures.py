"""A tensor-parallel rank that dies or stalls takes its engine down loudly (RankFailure,
an EngineStateError) within the collective timeout, and no follower outlives its
driver. Each case runs the engine in its own process, under a timeout."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

SCRIPT = r"""
import os, signal, sys, threading, time
from engine import LLM, SamplingParams
from engine.errors import RankFailure
llm = LLM(sys.argv[1], tensor_parallel_size=2, num_threads=1, distributed_timeout_s=3.0)
follower = llm.core.tp._procs[0]
print("FOLLOWER", follower.pid, flush=True)
params = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2), use_tqdm=False)  # the group works
fault = sys.argv[2]
if fault == "driver-exits":
    os._exit(0)  # as if killed: no close(), no stop order
if fault == "driver-forward":  # rank 0 alone raises inside a broadcast step
    mlp = llm.core.model.layers[1].mlp
    mlp.forward = lambda *a, **k: (_ for _ in ()).throw(MemoryError("rank 0 only"))
    start = time.monotonic()
    for attempt in range(2):
        try:
            llm.generate([[5, 6, 7]], params, use_tqdm=False)
        except RankFailure as exc:
            print("FAILED AFTER %.1f: %s" % (time.monotonic() - start, exc), flush=True)
    os._exit(0)
if fault.startswith("idle-"):  # no request comes: the worker loop's idle health check finds it
    os.kill(follower.pid, signal.SIGKILL if fault == "idle-kill" else signal.SIGSTOP)
    start = time.monotonic()
    while time.monotonic() - start < 30:
        try:
            llm.core.check_health()
        except RankFailure as exc:
            print("FAILED AFTER %.1f: %s" % (time.monotonic() - start, exc), flush=True)
            break
        time.sleep(0.05)
    os.kill(follower.pid, signal.SIGKILL)
    os._exit(0)
threading.Timer(0.5, os.kill, (follower.pid, signal.SIGKILL if fault == "kill" else signal.SIGSTOP)).start()
start = time.monotonic()
try:
    llm.generate([[5, 6, 7]] * 4, params, use_tqdm=False)
    print("NO FAILURE", flush=True)
except RankFailure as exc:
    print("FAILED AFTER %.1f: %s" % (time.monotonic() - start, exc), flush=True)
if fault == "stall":
    os.kill(follower.pid, signal.SIGKILL)
os._exit(0)
"""


def run(model_dir: Path, fault: str) -> tuple[str, int]:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(model_dir), fault], capture_output=True,
                          text=True, timeout=180, env=env, cwd=REPO)
    out = proc.stdout
    assert "FOLLOWER" in out, proc.stdout + proc.stderr[-3000:]
    pid = int(out.split("FOLLOWER ")[1].split()[0])
    return out, pid


def gone(pid: int, within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    return False


# Idle: a stopped rank is found by the heartbeat (every 5 s) within the 3 s timeout.
@pytest.mark.parametrize("fault,bound_s", [("kill", 5.0), ("stall", 10.0), ("idle-kill", 1.0), ("idle-stall", 10.0)])
def test_a_dead_or_stalled_rank_fails_the_engine_loudly(tiny_models: dict[str, Path], fault: str,
                                                       bound_s: float) -> None:
    out, pid = run(tiny_models["llama"], fault)
    assert "FAILED AFTER" in out, out
    elapsed = float(out.split("FAILED AFTER ")[1].split(":")[0])
    assert elapsed < bound_s, out  # the 3 s collective timeout, not a hang
    assert "tensor-parallel" in out
    assert gone(pid, 5.0)


def test_no_follower_outlives_its_driver(tiny_models: dict[str, Path]) -> None:
    _, pid = run(tiny_models["llama"], "driver-exits")
    assert gone(pid, 10.0)  # its stdin closed with the driver


def test_rank_0_failing_alone_breaks_the_group_at_once(tiny_models: dict[str, Path]) -> None:
    """Its followers wait in that step's collectives: not a failure of the requests, and
    no later step may wait for the collective timeout again."""
    out, _ = run(tiny_models["llama"], "driver-forward")
    failures = [line for line in out.splitlines() if line.startswith("FAILED AFTER")]
    assert len(failures) == 2, out
    assert "out of step" in failures[0] and "failed earlier" in failures[1]
    assert float(failures[1].split()[2].rstrip(":")) < 2.0  # not the 3 s timeout


def test_a_driver_killed_while_starting_leaves_no_follower_and_no_cache_file(tiny_models: dict[str, Path]) -> None:
    """Killed before its followers joined it (they were still importing torch): they see
    their parent gone; its rank caches, whose names it told nobody, are swept by the
    next driver (or launcher) on this host."""
    from engine.distributed.shm_files import SHM_DIR, sweep_orphans

    code = ("import sys; from engine import LLM; "
            "LLM(sys.argv[1], tensor_parallel_size=2, num_threads=1, num_kv_blocks=4096)")
    for _ in range(3):  # a driver that got through its start before we caught it is tried again
        driver = subprocess.Popen([sys.executable, "-c", code, str(tiny_models["llama"])], cwd=REPO,
                                  env=dict(os.environ, PYTHONPATH=str(REPO)), stderr=subprocess.DEVNULL)
        follower, deadline = None, time.monotonic() + 60
        while follower is None and time.monotonic() < deadline and driver.poll() is None:
            children = Path(f"/proc/{driver.pid}/task/{driver.pid}/children").read_text().split()
            follower = int(children[0]) if children else None
            time.sleep(0.01)
        mine = f"pdserve-kv-tp{driver.pid}-"
        while (not any(n.startswith(mine) for n in os.listdir(SHM_DIR)) and time.monotonic() < deadline
               and driver.poll() is None):
            time.sleep(0.01)  # until its rank caches exist (the follower is still starting)
        driver.kill()
        driver.wait()
        if driver.returncode != 0:  # killed here, in its start
            break
    assert follower is not None and gone(follower, 15.0)
    # Swept here, or already by a driver starting alongside (the suite runs TP engines
    # side by side, and each sweeps at its start): what a sweep removes is the next test's.
    sweep_orphans()
    assert not any(n.startswith(mine) for n in os.listdir(SHM_DIR))


def test_a_sweep_removes_the_rank_caches_of_drivers_gone_and_no_other(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    from engine.distributed import shm_files

    monkeypatch.setattr(shm_files, "SHM_DIR", str(tmp_path))  # no other driver's sweep reaches it
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    for pid in (dead.pid, os.getpid()):
        for r in range(2):
            (tmp_path / f"{shm_files.PREFIX}tp{pid}-0123abcd-rank{r}").write_bytes(b"")
    (tmp_path / f"{shm_files.PREFIX}shm-some-transport-segment").write_bytes(b"")  # not a rank cache
    swept = sorted(os.path.basename(p) for p in shm_files.sweep_orphans())
    assert swept == [f"{shm_files.PREFIX}tp{dead.pid}-0123abcd-rank{r}" for r in range(2)]
    assert sorted(os.listdir(tmp_path)) == sorted([f"{shm_files.PREFIX}shm-some-transport-segment"] + [
        f"{shm_files.PREFIX}tp{os.getpid()}-0123abcd-rank{r}" for r in range(2)])


def test_a_relative_model_path_works_from_any_directory(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    (tmp_path / "m").symlink_to(tiny_models["llama"])
    code = ("from engine import LLM, SamplingParams; p = SamplingParams(max_tokens=4, temperature=0.0); "
            "print('TOKENS', LLM('m', tensor_parallel_size=2, num_threads=1).generate([[5, 6]], p, use_tqdm=False)[0].token_ids, "
            "LLM('m').generate([[5, 6]], p, use_tqdm=False)[0].token_ids)")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=dict(os.environ, PYTHONPATH=str(REPO)),
                         capture_output=True, text=True, timeout=180).stdout
    tp2, tp1 = out.split("TOKENS ")[1].strip().split("] [")
    assert tp2 + "]" == "[" + tp1 and len(tp2) > 3


def test_a_follower_failing_to_start_is_named_with_its_cause(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    # Only followers attach a cache file: make that fail in every process started here.
    (tmp_path / "sitecustomize.py").write_text(
        "import engine.distributed.shared_cache as c\n"
        "def attach(*args):\n    raise FileNotFoundError('no cache file here (test)')\n"
        "c.attach = attach\n")
    code = ("import sys\nfrom engine import LLM\ntry:\n"
            "    LLM(sys.argv[1], tensor_parallel_size=2, num_threads=1)\n"
            "except Exception as exc:\n    print('FAILED', type(exc).__name__, exc)\n")
    env = dict(os.environ, PYTHONPATH=f"{tmp_path}{os.pathsep}{REPO}")
    out = subprocess.run([sys.executable, "-c", code, str(tiny_models["llama"])], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=180).stdout
    assert "FAILED RankFailure tensor-parallel rank 1 of 2 exited with code 1: " in out, out
    assert "FileNotFoundError: no cache file here (test)" in out
