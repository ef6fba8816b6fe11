"""The short chaos run (benchmarks/chaos/run.py): a real `pdserve serve` of the demo model
(1 prefill + 2 decode workers on CPU, configs/chaos.yaml) under Poisson load while
its workers are killed and stopped, clients hang up, bad bodies and floods hit the
router and a stranger writes to the worker sockets. Each target is its own test, so a
missed one is named; the run happens once, in a subprocess whose process group holds
everything it starts, killed whole if it outlives its hard timeout.

Memory is checked loosely here (a short run is mostly warm-up); the 5% target is the
30-minute soak's (docs/benchmarks/2026-12-02-chaos-soak.md).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from cluster.demo_model import DEMO_MODELS, default_models_dir

REPO = Path(__file__).resolve().parents[2]
MODEL_DIR = default_models_dir() / DEMO_MODELS["smollm2"].dir_name
MINUTES = 0.75
HARD_TIMEOUT_S = 420

pytestmark = pytest.mark.skipif(not (MODEL_DIR / "config.json").is_file(),
                                reason=f"demo model not prepared at {MODEL_DIR} (make model)")


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> dict:
    tmp = tmp_path_factory.mktemp("chaos")
    cmd = [sys.executable, str(REPO / "benchmarks" / "chaos" / "run.py"), "--minutes", str(MINUTES), "--seed", "18",
           "--model", str(MODEL_DIR), "--rss-tolerance", "0.25", "--json", str(tmp / "chaos.json"),
           "--log", str(tmp / "serve.log")]
    proc = subprocess.Popen(cmd, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=HARD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)  # it stops its deployment and reports
        try:
            out, _ = proc.communicate(timeout=90)
        except subprocess.TimeoutExpired:
            out = ""
        pytest.fail(f"the chaos run outlived {HARD_TIMEOUT_S} s:\n{out[-4000:]}")
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # whatever is left of its group: pdserve, workers
        except ProcessLookupError:
            pass
    assert proc.returncode in (0, 1), f"the chaos run failed to run (exit {proc.returncode}):\n{out[-4000:]}"
    print(out)
    return json.loads((tmp / "chaos.json").read_text())


def _target(report: dict, words: str) -> dict:
    return next(t for t in report["targets"] if words in t["target"])


@pytest.mark.timeout(HARD_TIMEOUT_S + 120)
def test_the_run_made_every_kind_of_trouble(report: dict) -> None:
    """Not a target: the harness did what it says, so that a pass means something."""
    done = [f for f in report["faults"] if f["pid"]]
    for action in ("kill", "stop"):
        for pool in ("prefill", "decode"):
            assert sum(f["action"] == action and f["worker"].startswith(pool) for f in done) >= 2, report["faults"]
    assert all(f["end"] is not None for f in done), "a faulted worker did not come back"
    load = report["requests"]["load"]
    assert load["completed"] > 0 and load["dropped_by_client"] > 0 and load["streams"] > 0
    assert report["requests"]["flood"]["failed"].get("http_429", 0) > 0, "the floods never reached the queue bound"
    assert report["requests"]["fuzz"]["sent"] >= 50 and report["forged"]


@pytest.mark.timeout(HARD_TIMEOUT_S + 120)
def test_no_request_is_lost_while_a_decode_worker_lives(report: dict) -> None:
    target = _target(report, "no request lost")
    assert target["ok"], (target, report["requests"]["load"]["lost_examples"], report["requests"]["flood"])


@pytest.mark.timeout(HARD_TIMEOUT_S + 120)
def test_no_kv_block_leaks_after_the_drain(report: dict) -> None:
    target = _target(report, "leaked")
    assert target["ok"], target


@pytest.mark.timeout(HARD_TIMEOUT_S + 120)
def test_bad_input_never_gets_a_5xx(report: dict) -> None:
    target = _target(report, "5xx")
    assert target["ok"], target


@pytest.mark.timeout(HARD_TIMEOUT_S + 120)
def test_memory_stays_flat_after_warm_up(report: dict) -> None:
    target = _target(report, "memory flat")
    assert target["ok"], (target, report["rss"])


@pytest.mark.timeout(HARD_TIMEOUT_S + 120)
def test_no_unauthenticated_worker_message_is_acted_on(report: dict) -> None:
    target = _target(report, "unauthenticated")
    assert target["ok"], target
