"""A worker whose start fails (here: no model) closes the transport it had opened: a
zmq context left to the garbage collector can hang whichever collection finds it."""

from __future__ import annotations

from pathlib import Path

import pytest

import workers.start
from engine.config import EngineConfig
from kv_transfer import create_transport
from workers.config import WorkerConfig
from workers.start import engine_and_transport


@pytest.mark.timeout(60)
def test_a_failed_start_closes_its_transport(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    opened = []

    def create(*args, **kwargs):
        opened.append(create_transport(*args, **kwargs))
        return opened[-1]

    monkeypatch.setattr(workers.start, "create_transport", create)
    worker = WorkerConfig("decode", 0, EngineConfig(model=str(tmp_path / "no-model")), "shm")
    with pytest.raises(FileNotFoundError, match="no-model"):
        engine_and_transport(worker)
    assert len(opened) == 1 and opened[0].control.ctx.closed
