"""benchmarks/serving/serve_compare.py: P5 and P6 from two serve.py JSONs, per seed and pooled."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.serving.compare import compare, ratio_rows

ROOT = Path(__file__).resolve().parents[2]


def _report(ttft: float, tpot: float, seeds=(0, 1, 2), rates=(0.1, 1.0), throughput=0.5, failed=0) -> dict:
    runs = []
    for seed in seeds:
        for rate in rates:
            # 100 requests, TTFT and TPOT the same for all but one slow request per seed.
            results = [{"ok": True, "ttft": ttft * (3 if i == 0 else 1) * (1 + seed / 10),
                        "e2e": ttft + tpot * 9, "output_tokens": 10} for i in range(100)]
            results += [{"ok": False, "ttft": 0.0, "e2e": 0.0, "output_tokens": 10}] * failed  # left out
            runs.append({"seed": seed, "load": "poisson", "rate": rate, "results": results,
                         "request_throughput": throughput})
    return {"runs": runs}


def _args(report: dict, **changes) -> dict:
    """The report with the arguments serve.py records, as the command that made it."""
    rates = sorted({run["rate"] for run in report["runs"]})
    args = {"config": None, "url": "http://127.0.0.1:8000/v1", "model": None, "rates": ",".join(map(str, rates)),
            "concurrency": None, "duration": 60.0, "num_requests": 100, "prompt_len": [50, 400],
            "prompt_tokens": [600, 1200], "token_ids": [1000, 30000], "output_len": [8, 32], "shared_prefix": 0,
            "slo_ttft": 5.0, "slo_tpot": 0.5, "seed": None, "seeds": sorted({run["seed"] for run in report["runs"]}),
            "port": None, "json_path": "results/x.json"}
    return report | {"args": args | changes}


def _cli(tmp_path: Path, *reports) -> subprocess.CompletedProcess:
    paths = []
    for i, report in enumerate(reports):
        paths.append(tmp_path / f"{i}.json")
        paths[-1].write_text(report if isinstance(report, str) else json.dumps(report))
    # Through the serving group's entry point (the file itself is run below).
    return subprocess.run([sys.executable, "-m", "benchmarks.serving", "serve_compare", *map(str, paths)], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)


def test_ratios_per_seed_and_pooled() -> None:
    d, c = _report(1.1, 0.02), _report(1.0, 0.05)
    r = ratio_rows(d, c, "rate 0.1/s", "ttft", "p50")
    assert set(r["per_seed"]) == {0, 1, 2} and r["requests"] == (300, 300)
    for seed, (a, _b, ratio) in r["per_seed"].items():
        assert a == pytest.approx(1.1 * (1 + seed / 10)) and ratio == pytest.approx(1.1)
    assert r["pooled"][2] == pytest.approx(1.1) and r["spread"] == pytest.approx((1.1, 1.1))
    tpot = ratio_rows(d, c, "rate 1.0/s", "tpot", "p99")
    # TPOT = (e2e - ttft) / 9: the slow-first-token request has a shorter TPOT, not longer.
    assert tpot["pooled"][1] == pytest.approx((1.0 + 0.45 - 1.0) / 9, rel=0.05)
    table = compare(d, c)
    assert "| P5 | rate 0.1/s | TTFT p50 | pooled (300 / 300 req), seeds 1.10-1.10x" in table
    assert "met (<= 1.15x)" in table and "| P6 | rate 1.0/s | TPOT p99 |" in table
    assert table.count("\n") == 1 + 3 * 4  # header, rule, then 3 seeds + pooled per row group


def test_load_points_must_match(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="share no load point"):
        compare(_report(1, 1, rates=(0.1,)), _report(1, 1, rates=(0.2,)))
    with pytest.raises(ValueError, match="share no load point"):  # other seeds: not the same requests
        compare(_report(1, 1, seeds=(0,)), _report(1, 1, seeds=(1,)))
    with pytest.raises(ValueError, match="'rate 5/s' is not in both"):
        compare(_report(1, 1), _report(1, 1), p6_point="rate 5/s")
    out = _cli(tmp_path, _args(_report(1.1, 0.02)), _args(_report(1.0, 0.05), url="http://other:9/v1"))
    assert out.returncode == 0 and "**0.40x** | | met (<= 0.5x)" in out.stdout, out.stderr


def test_a_load_point_with_failed_requests_gets_no_verdict(tmp_path: Path) -> None:
    """The completed requests of an overloaded setup (429s) are not its latency: the
    labels count them, and the verdict says how many failed instead of met / not met."""
    d, c = _report(1.1, 0.02), _report(1.0, 0.05, failed=2)
    r = ratio_rows(d, c, "rate 0.1/s", "ttft", "p50")
    assert r["requests"] == (300, 300) and r["failed"] == (0, 6) and r["sent"] == (300, 306)
    assert r["pooled"][2] == pytest.approx(1.1)  # the failed ones are left out of the ratios
    table = compare(d, c)
    assert "pooled (300 / 300 req)" in table and " met " not in table and "not met" not in table
    assert table.count("no verdict: requests failed, disaggregated 0 of 300, colocated 6 of 306") == 3
    out = _cli(tmp_path, _args(d), _args(c))
    assert out.returncode == 1 and "no verdict" in out.stdout and "requests failed" in out.stderr


@pytest.mark.parametrize("change", [{"prompt_tokens": [80, 150]}, {"output_len": [2, 6]}, {"shared_prefix": 10},
                                    {"num_requests": 50}, {"token_ids": [0, 100]}, {"seeds": [0, 1, 3]},
                                    {"rates": "0.1,2"}, {"concurrency": "4"}])
def test_reports_of_different_commands_are_refused(change: dict) -> None:
    option = "--" + next(iter(change)).replace("_", "-")
    with pytest.raises(ValueError, match=f"different serve.py commands.*{option} "):
        compare(_args(_report(1.1, 0.02)), _args(_report(1.0, 0.05), **change))


def test_what_is_not_the_workload_may_differ() -> None:
    same = {"url": "http://b/v1", "port": 1, "json_path": "y.json", "config": "c.yaml", "slo_ttft": 1.0,
            "rates": "0.1,1", "seeds": [2, 1, 0], "prompt_len": [1, 2], "duration": 5.0}  # unused with these
    assert "met" in compare(_args(_report(1.1, 0.02)), _args(_report(1.0, 0.05), **same))
    with pytest.raises(ValueError, match="--prompt-len"):  # used by word prompts
        compare(_args(_report(1.1, 0.02), prompt_tokens=None), _args(_report(1.0, 0.05), **same, prompt_tokens=None))


def test_files_it_cannot_compare_are_a_usage_error(tmp_path: Path) -> None:
    good = _args(_report(1.1, 0.02))
    out = _cli(tmp_path, good, _args(_report(1.0, 0.05), output_len=[2, 6]))
    assert out.returncode == 2 and "serve_compare.py: error: the two files come from different serve.py commands, so" \
        " their requests differ (disaggregated vs colocated): --output-len [8, 32] vs [2, 6]" in out.stderr, out.stderr
    for bad, message in (('{"runs": [', "is not JSON"), ("not json", "is not JSON"), ("[]", "holds a JSON list"),
                         (json.dumps(_report(1, 1)), "no 'args' object"),
                         (json.dumps({"args": {}, "runs": [{"seed": 0}]}), "runs[0] has no 'load'"),
                         (json.dumps(good | {"runs": [{**good["runs"][0], "results": [{"ok": True}]}]}),
                          "runs[0].results[0] has no 'ttft'")):
        out = _cli(tmp_path, good, bad)
        assert out.returncode == 2 and message in out.stderr and "Traceback" not in out.stderr, (bad, out.stderr)
        assert out.stderr.splitlines()[-1].startswith("serve_compare.py: error: ")
    out = subprocess.run([sys.executable, "benchmarks/serving/serve_compare.py", str(tmp_path / "0.json"),
                          str(tmp_path / "missing.json")], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "serve_compare.py: error: cannot read " in out.stderr and "missing.json" in out.stderr
