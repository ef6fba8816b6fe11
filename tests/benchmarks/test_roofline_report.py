"""`python -m benchmarks.offline roofline`: the plots are written for a synthetic measured report and a
synthetic serve.py report, the table and JSON come back through --from-json, and bad
arguments get errors that name them. No engine runs here."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.offline.roofline import cli, plots
from benchmarks.offline.roofline import report as rep
from benchmarks.offline.roofline.analytic import ModelShape
from benchmarks.offline.roofline.measure import Measured
from benchmarks.offline.roofline.roofs import Roof

TINY = ModelShape(64, 128, 2, 4, 2, 16, 384, True)
ROOF = Roof("test roofs", bytes_per_s=10e9, flops_per_s=50e9)
PNG = b"\x89PNG\r\n\x1a\n"


def synthetic_report() -> dict:
    measured = [Measured("decode", b, 1, c, 1e-3 * b ** 0.5 * (1 + c / 100), 3, (c + 1, c + 2))
                for c in (16, 64) for b in (1, 2, 4)]
    measured.append(Measured("prefill", 1, 32, 16, 5e-3, 3, (16,)))
    return rep.make_report("tiny", "cpu", "float32", TINY, ROOF, rep.measured_rows(TINY, 4, ROOF, measured))


def serve_report(ttfts: list[float], tokens: int = 8) -> dict:
    results = [{"prompt_words": 10, "output_tokens": tokens, "ok": True, "error": "", "ttft": t,
                "e2e": t + 0.05 * (tokens - 1), "itl": None} for t in ttfts]
    results.append({"prompt_words": 10, "output_tokens": tokens, "ok": False, "error": "HTTP 500",
                    "ttft": 0.0, "e2e": 0.0, "itl": None})
    return {"url": "http://127.0.0.1:1/v1", "model": "tiny", "rates": {"0.5": {"results": results}}}


def assert_png(path: Path) -> None:
    assert path.is_file() and path.stat().st_size > 1000
    assert path.read_bytes()[:8] == PNG


def test_rows_set_each_measured_step_against_its_floor() -> None:
    report = synthetic_report()
    first = report["rows"][0]
    # The floor is the mean over the timed contexts (17 and 18), between theirs.
    low, high = (rep.floor_row(TINY, 4, ROOF, "decode", 1, 1, c)["floor_s"] for c in (17, 18))
    assert low < first["floor_s"] < high
    assert first["ratio"] == pytest.approx(first["measured_s"] / first["floor_s"])
    table = rep.format_table(report)
    assert table.count("\n") == 2 + len(report["rows"]) - 1
    assert "| prefill 32 | 1 | 16 |" in table


def test_plots_are_written(tmp_path: Path) -> None:
    report = synthetic_report()
    assert_png(plots.plot_roofline(report, tmp_path / "roof.png"))
    assert_png(plots.plot_step_times(report, tmp_path / "steps.png"))
    serve = [serve_report([0.5, 0.7, 0.9]), serve_report([0.6, 1.2, 2.0])]
    assert_png(plots.plot_serve_cdfs(serve, ["disaggregated", "colocated"], tmp_path / "cdf.png"))


def test_serve_latencies_of_one_load_point_of_a_runs_report() -> None:
    """serve.py's "runs" format (seeds x load points): every seed of the chosen point."""
    def run(seed: int, load: dict, ttfts: list[float]) -> dict:
        return {"seed": seed, **load, "results": serve_report(ttfts)["rates"]["0.5"]["results"]}

    closed, poisson = {"load": "concurrency", "concurrency": 1}, {"load": "poisson", "rate": 0.3}
    report = {"runs": [run(0, closed, [0.1]), run(0, poisson, [0.5, 0.6]), run(1, closed, [0.2]),
                       run(1, poisson, [0.7])]}
    assert sorted(plots.serve_latencies(report, "rate 0.3/s")[0]) == [0.5, 0.6, 0.7]
    assert sorted(plots.serve_latencies(report, "concurrency 1")[0]) == [0.1, 0.2]
    assert len(plots.serve_latencies(report)[0]) == 5
    with pytest.raises(ValueError, match="no run at 'rate 9.0/s'"):
        plots.serve_latencies(report, "rate 9.0/s")


def test_serve_latencies_skip_failed_requests() -> None:
    ttft, tpot = plots.serve_latencies(serve_report([0.5, 0.7], tokens=3))
    assert ttft == [0.5, 0.7]
    assert tpot == pytest.approx([0.05, 0.05])  # (e2e - ttft) / (3 - 1)


def test_from_json_prints_the_table_and_plots(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    saved = tmp_path / "report.json"
    saved.write_text(json.dumps(synthetic_report()))
    cli.main(["--from-json", str(saved), "--plots", str(tmp_path / "img"), "--json", str(tmp_path / "again.json")])
    out = capsys.readouterr().out
    assert "| decode | 4 | 64 |" in out and "roofs: test roofs" in out
    assert_png(tmp_path / "img" / "roofline-cpu.png")
    assert_png(tmp_path / "img" / "decode-steps-cpu.png")
    assert json.loads((tmp_path / "again.json").read_text()) == json.loads(saved.read_text())


def test_cdf_subcommand(tmp_path: Path) -> None:
    paths = []
    for name, ttfts in (("a", [0.5, 0.7]), ("b", [0.9, 1.1])):
        paths.append(tmp_path / f"{name}.json")
        paths[-1].write_text(json.dumps(serve_report(ttfts)))
    cli.main(["cdf", "--json", *map(str, paths), "--labels", "disaggregated,colocated",
              "--out", str(tmp_path / "cdf.png")])
    assert_png(tmp_path / "cdf.png")


def test_analytic_only_runs_no_engine(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 384}
    (tmp_path / "config.json").write_text(json.dumps(config))
    cli.main(["--model", str(tmp_path), "--analytic-only", "--roof", "h200", "--batches", "2,1",
              "--contexts", "10", "--prefill-chunk", "4", "--prefill-context", "16"])
    out = capsys.readouterr().out
    assert "analytic floors only" in out
    assert "| decode | 1 | 10 | - |" in out and "| decode | 2 | 10 | - |" in out
    assert "| prefill 4 | 1 | 16 | - |" in out


@pytest.mark.parametrize("argv, message", [
    (["--batches", "0,4"], "--batches must be integers >= 1, got '0,4'"),
    (["--contexts", "a"], "--contexts must be comma-separated integers, got 'a'"),
    (["--steps", "0"], "must be >= 1, got 0"),
    (["--model", "/nonexistent/model", "--analytic-only"], "--model /nonexistent/model: model directory"),
    (["--prefill-context", "10", "--analytic-only"], "--prefill-context must be a multiple of 16"),
    (["--device", "tpu", "--analytic-only"], "--device must be cpu or cuda[:N], got 'tpu'"),
    (["--from-json", "/nonexistent.json"], "cannot read report /nonexistent.json"),
    (["cdf", "--json", "a.json", "--labels", "a", "--out", "x.png"], "needs two or more serve reports"),
    (["cdf", "--json", "a.json", "b.json", "--labels", "a", "--out", "x.png"],
     "--labels names 1 reports but --json gives 2"),
    (["cdf", "--json", "a.json", "b.json", "--labels", "a,b", "--out", "x.png"], "cannot read serve report a.json"),
])
def test_argument_errors_name_the_problem(argv: list[str], message: str, capsys: pytest.CaptureFixture[str],
                                          monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_cdf_rejects_a_report_that_is_not_serves(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good, bad = tmp_path / "good.json", tmp_path / "bad.json"
    good.write_text(json.dumps(serve_report([0.5])))
    bad.write_text(json.dumps({"rows": []}))
    with pytest.raises(SystemExit):
        cli.main(["cdf", "--json", str(good), str(bad), "--labels", "a,b", "--out", str(tmp_path / "x.png")])
    assert "not a benchmarks/serving/serve.py --json report: it has no 'runs' list nor 'rates' object" in capsys.readouterr().err
