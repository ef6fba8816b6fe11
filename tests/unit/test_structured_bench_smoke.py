"""benchmarks/offline/structured.py --quick, mask and compile sections, on the demo model: the
script runs end to end and its figures are real (constrained engine rows went through
the grammar masks; a cache hit is cheaper than a cold compile)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cluster import demo_model as demo

MODEL_DIR = demo.default_models_dir() / demo.DEMO_MODELS["smollm2"].dir_name
needs_model = pytest.mark.skipif(not (MODEL_DIR / "model.safetensors").is_file(),
                                 reason=f"demo model not prepared at {MODEL_DIR}")


@needs_model
def test_quick_mask_and_compile_sections(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from benchmarks.offline import structured

    out = tmp_path / "report.json"
    structured.main(["--only", "mask,compile", "--quick", "--model", str(MODEL_DIR.resolve()), "--json", str(out)])
    printed = capsys.readouterr().out
    for heading in ("### Mask cost per step", "### Decode step, batch 2", "### Compile time"):
        assert heading in printed
    report = json.loads(out.read_text())
    assert [row["batch"] for row in report["mask"]] == [1, 4]
    for row in report["mask"]:
        assert all(stat["median"] > 0 for stat in row["ms"].values())
    engine = report["engine"]
    assert engine["plain"]["median"] > 0 and engine["constrained"]["median"] > 0
    # The constrained rows were masked and their matchers advanced; the plain ones not.
    assert engine["profile"]["constrained"]["  mask fill"] > 0
    assert engine["profile"]["constrained"]["matcher accept"] > 0
    assert "  mask fill" not in engine["profile"]["plain"]
    compile_ = report["compile"]
    assert compile_["cache_hit"]["median"] < compile_["cold_compile"]["median"] < compile_["tokenizer_info"]["median"]
