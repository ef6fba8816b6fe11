"""A Ray launch whose model directory is missing where `pdserve serve` runs fails there,
before any actor starts, saying how to fix it (no Ray needed: the check runs first)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

import cluster.serve
from cluster.cli import main
from cluster.config import ConfigError, check_ray_model_dir, load_cluster_config

REPO = Path(__file__).resolve().parents[2]
RAY_LOCAL = REPO / "configs" / "ray-local.yaml"  # model: models/SmolLM2-135M-Instruct, relative


def test_a_relative_model_missing_here_is_named_with_the_fix(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What `ray job submit --working-dir .` does: the job runs in an uploaded copy of
    the repository, without models/."""
    monkeypatch.chdir(tmp_path)
    config = load_cluster_config(RAY_LOCAL)
    with pytest.raises(ConfigError) as err:
        check_ray_model_dir(config)
    message = str(err.value)
    assert message.startswith(f"model: 'models/SmolLM2-135M-Instruct' (relative to {tmp_path}) does not exist")
    assert "absolute path every node can read" in message and "--model" in message
    assert "--working-dir` does not upload models/" in message


def test_a_directory_without_a_model_and_one_with_it(tmp_path: Path, llama_dir: Path) -> None:
    config = load_cluster_config(RAY_LOCAL)
    with pytest.raises(ConfigError, match=rf"^model: '{tmp_path}' has no config.json on this node"):
        check_ray_model_dir(dataclasses.replace(config, model=str(tmp_path)))
    check_ray_model_dir(dataclasses.replace(config, model=str(llama_dir)))


def test_pdserve_serve_checks_before_starting_anything(tmp_path: Path, llama_dir: Path,
                                                       monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """Through the command: exit status 2 and the message, and Ray never started; with
    `--model` (checked after the override) the launch goes ahead."""
    launched = []
    monkeypatch.setattr(cluster.serve, "serve", lambda config, detach: launched.append(config))
    monkeypatch.chdir(tmp_path)
    assert main(["serve", str(RAY_LOCAL)]) == 2
    assert "pdserve: error: model: 'models/SmolLM2-135M-Instruct'" in capsys.readouterr().err
    assert not launched
    local = tmp_path / "local.yaml"  # the same model under the local launcher: not checked here
    local.write_text((REPO / "configs" / "local.yaml").read_text())
    assert main(["serve", str(local)]) == 0 and launched.pop().launcher == "local"
    assert main(["serve", str(local), "--ray"]) == 2 and not launched
    assert main(["serve", str(RAY_LOCAL), "--model", str(llama_dir)]) == 0
    assert launched[0].model == str(llama_dir) and launched[0].launcher == "ray"
