"""Serving on another port when 8000 is taken, as the README says: `pdserve serve CONFIG
--port N` overrides the config's `router.port`, and without it the config's port holds."""

from __future__ import annotations

from pathlib import Path

import pytest

import cluster.serve
from cluster.cli import main

LOCAL = Path(__file__).resolve().parents[2] / "configs" / "local.yaml"


def test_port_flag_overrides_router_port(llama_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    launched = []
    monkeypatch.setattr(cluster.serve, "serve", lambda config, detach: launched.append(config))
    assert main(["serve", str(LOCAL), "--model", str(llama_dir)]) == 0
    assert launched.pop().router.port == 8000  # configs/local.yaml's
    assert main(["serve", str(LOCAL), "--port", "8001", "--model", str(llama_dir)]) == 0
    config = launched.pop()
    assert config.router.port == 8001 and config.model == str(llama_dir)


def test_a_port_that_is_not_a_number_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["serve", str(LOCAL), "--port", "eighty"])
    assert exit_.value.code == 2 and "--port: invalid int value: 'eighty'" in capsys.readouterr().err
