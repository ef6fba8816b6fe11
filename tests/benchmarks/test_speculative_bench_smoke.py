"""benchmarks/offline/speculative.py --quick on the tiny Llama: the sweep and every case run, the
JSON has the shape docs/benchmarks/2026-12-02-speculative.md's table is made from, and each greedy case's
speculative tokens equal the plain engine's (with drafts actually tried)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ROW_KEYS = {"workload", "batch", "setting", "speculative_config", "output_tokens", "seconds", "median_seconds",
            "tokens_per_s", "vs_baseline", "cpu_seconds", "tokens_per_cpu_s", "vs_baseline_cpu",
            "acceptance_rate", "mean_accepted_length", "requests_disabled", "output_tokens_per_step",
            "cpu_ms_per_step", "propose_cpu_ms_per_step", "tokens_identical", "repeatable"}


@pytest.mark.timeout(120)
def test_quick_run_writes_every_case_and_greedy_tokens_match(llama_dir: Path, tmp_path: Path) -> None:
    out_json = tmp_path / "spec.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, "benchmarks/offline/speculative.py", "--quick", "--model", str(llama_dir),
                          "--json", str(out_json)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=110)
    assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]
    report = json.loads(out_json.read_text())

    swept = {r["setting"] for r in report["sweep"]}
    assert swept == {"baseline", "ngram k=2, lookup 2-4", "ngram k=4, lookup 2-4", "ngram k=4, lookup 1-4"}
    assert report["best"] in swept - {"baseline"}
    cases = {(r["workload"], r["batch"], r["setting"]) for r in report["cases"]}
    assert cases == {(w, b, s) for w in ("repetitive", "random") for b in (1, 2) for s in ("baseline", report["best"])}
    for row in report["sweep"] + report["cases"]:
        assert ROW_KEYS <= set(row), f"missing {ROW_KEYS - set(row)} in {row['setting']}"
        assert row["output_tokens"] > 0 and row["tokens_per_s"] > 0 and len(row["seconds"]) == 1
        assert row["repeatable"]
        # Greedy (repetitive): equal to the baseline's tokens; sampled (random): not compared.
        assert row["tokens_identical"] is (True if row["workload"] == "repetitive" else None), row
        if row["setting"] == "baseline":
            assert row["vs_baseline"] == 1.0 and row["acceptance_rate"] is None
    # The equality means something only if drafts were verified.
    spec_rows = [r for r in report["sweep"] if r["setting"] != "baseline"]
    assert all(r["acceptance_rate"] is not None and r["mean_accepted_length"] >= 1 for r in spec_rows), spec_rows
    assert report["tokens_identical"] is True
    assert "| repetitive | 1 | baseline |" in run.stdout
