"""A tensor-parallel rank that dies or stalls takes its engine down loudly (RankFailure,
an EngineStateError) within the collective timeout, and no follower outlives its
driver. Each case runs the engine in its own process, under a timeout."""

from __future__ import annotations

import os
import signal
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


@pytest.mark.parametrize("fault,bound_s", [("kill", 5.0), ("stall", 10.0)])
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
