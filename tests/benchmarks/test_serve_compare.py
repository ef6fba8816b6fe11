"""benchmarks/serve_compare.py: P5 and P6 from two serve.py JSONs, per seed and pooled."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.serving.compare import compare, ratio_rows

ROOT = Path(__file__).resolve().parents[2]


def _report(ttft: float, tpot: float, seeds=(0, 1, 2), rates=(0.1, 1.0), throughput=0.5) -> dict:
    runs = []
    for seed in seeds:
        for rate in rates:
            # 100 requests, TTFT and TPOT the same for all but one slow request per seed.
            results = [{"ok": True, "ttft": ttft * (3 if i == 0 else 1) * (1 + seed / 10),
                        "e2e": ttft + tpot * 9, "output_tokens": 10} for i in range(100)]
            results.append({"ok": False, "ttft": 0.0, "e2e": 0.0, "output_tokens": 10})  # failed: left out
            runs.append({"seed": seed, "load": "poisson", "rate": rate, "results": results,
                         "request_throughput": throughput})
    return {"runs": runs}


def test_ratios_per_seed_and_pooled() -> None:
    d, c = _report(1.1, 0.02), _report(1.0, 0.05)
    r = ratio_rows(d, c, "rate 0.1/s", "ttft", "p50")
    assert set(r["per_seed"]) == {0, 1, 2} and r["requests"] == (303, 303)
    for seed, (a, b, ratio) in r["per_seed"].items():
        assert a == pytest.approx(1.1 * (1 + seed / 10)) and ratio == pytest.approx(1.1)
    assert r["pooled"][2] == pytest.approx(1.1) and r["spread"] == pytest.approx((1.1, 1.1))
    tpot = ratio_rows(d, c, "rate 1.0/s", "tpot", "p99")
    # TPOT = (e2e - ttft) / 9: the slow-first-token request has a shorter TPOT, not longer.
    assert tpot["pooled"][1] == pytest.approx((1.0 + 0.45 - 1.0) / 9, rel=0.05)
    table = compare(d, c)
    assert "| P5 | rate 0.1/s | TTFT p50 | pooled (303 / 303 req), seeds 1.10-1.10x" in table
    assert "met (<= 1.15x)" in table and "| P6 | rate 1.0/s | TPOT p99 |" in table
    assert table.count("\n") == 1 + 3 * 4  # header, rule, then 3 seeds + pooled per row group


def test_load_points_must_match(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="share no load point"):
        compare(_report(1, 1, rates=(0.1,)), _report(1, 1, rates=(0.2,)))
    with pytest.raises(ValueError, match="share no load point"):  # other seeds: not the same requests
        compare(_report(1, 1, seeds=(0,)), _report(1, 1, seeds=(1,)))
    with pytest.raises(ValueError, match="'rate 5/s' is not in both"):
        compare(_report(1, 1), _report(1, 1), p6_point="rate 5/s")
    paths = [tmp_path / "d.json", tmp_path / "c.json"]
    for path, report in zip(paths, (_report(1.1, 0.02), _report(1.0, 0.05))):
        path.write_text(json.dumps(report))
    out = subprocess.run([sys.executable, "benchmarks/serve_compare.py", *map(str, paths)], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "**0.40x** | | met (<= 0.5x)" in out.stdout, out.stderr
