"""benchmarks/elastic/autoscale.py on the tiny Llama, a trace of seconds: a fixed arm and the
scripted arm run, the report has the shape docs/benchmarks/2026-12-02-elastic-pools.md's table is made from, and
worker-seconds are measured from the pools as they changed (the scripted arm drops a
decode worker after its first phase), not read off the arm's starting shape. The
smallest shapes (no prefill worker) keep it quick: every worker's start costs seconds."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
RUN_KEYS = {"arm", "repeat", "seed", "requests", "failed", "window_s", "goodput", "within_slo", "ttft_p90",
            "tpot_p90", "worker_s", "process_s", "max_workers", "scale_events", "phases", "pools"}
PHASE_S = 2.0


def _left_behind(marker: str) -> list[int]:
    """Processes that inherited this run's environment (its deployments' workers)."""
    out = []
    for p in psutil.process_iter():
        try:
            if p.environ().get("AUTOSCALE_SMOKE") == marker:
                out.append(p.pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            pass
    return out


@pytest.mark.timeout(90)
def test_fixed_and_scripted_arms_report_measured_worker_seconds(llama_dir: Path, tmp_path: Path) -> None:
    config = tmp_path / "tiny.yaml"
    config.write_text(yaml.safe_dump({
        "model": str(llama_dir), "transport": "shm", "router": {"remote_prefill_min_tokens": 64},
        "prefill": {"engine": {"num_kv_blocks": 256, "max_num_batched_tokens": 512, "num_threads": 1}},
        "decode": {"engine": {"num_kv_blocks": 512, "num_threads": 1}}}))
    out_json = tmp_path / "autoscale.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "AUTOSCALE_SMOKE": str(tmp_path)}
    run = subprocess.run([sys.executable, "benchmarks/elastic/autoscale.py", "--config", str(config), "--arms", "0p1d,scripted",
                          "--script", "0p2d,0p1d,0p1d", "--phase-s", str(PHASE_S), "--scale", "4", "--repeats", "1",
                          "--json", str(out_json), "--log-dir", str(tmp_path / "logs")],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=85)
    assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]
    assert not _left_behind(str(tmp_path)), "an arm left processes behind"
    report = json.loads(out_json.read_text())

    assert report["trace"]["seconds"] == 3 * PHASE_S and report["args"]["max_workers"] == 3
    runs = {r["arm"]: r for r in report["runs"]}
    assert set(runs) == {"0p1d", "scripted"} and set(report["medians"]) == set(runs)
    for r in runs.values():
        assert RUN_KEYS <= set(r), f"missing {RUN_KEYS - set(r)} in {r['arm']}"
        assert r["requests"] == report["trace"]["requests"] > 0 and r["failed"] == 0, r["errors"]
        assert r["window_s"] >= 3 * PHASE_S and 0 <= r["within_slo"] <= 1
        assert set(r["phases"]) == {"prefill-heavy", "decode-heavy", "idle"}
        # Processes count the workers still loading or draining too: never fewer.
        assert r["process_s"] >= r["worker_s"] * 0.95
    fixed, scripted = runs["0p1d"], runs["scripted"]
    assert fixed["worker_s"] == pytest.approx(fixed["window_s"], rel=0.05)
    assert fixed["max_workers"] == 1 and fixed["scale_events"] == 0 and fixed["pools"][0][1:3] == [0, 1]
    # Two workers for the first phase and the drain, one after: between the two shapes' worth.
    assert scripted["window_s"] < scripted["worker_s"] < 2 * scripted["window_s"] - 0.5
    assert scripted["max_workers"] == 2 and scripted["scale_events"] == 1
    assert scripted["pools"][0][1:3] == [0, 2] and scripted["pools"][-1][1:3] == [0, 1]
    call = scripted["scale_calls"][0]
    assert call["targets"] == {"decode": 1} and call["result"]["removed"] == ["decode-1"]
    assert "| 0p1d | 1 |" in run.stdout and "| scripted | 1 |" in run.stdout
