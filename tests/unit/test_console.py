"""What `pdserve serve` prints besides its own lines (cluster/console.py): the pdserve
loggers' records on stderr, once each however often it is configured, through
whatever stderr is when they come."""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator

import pytest

from cluster import console
from engine.config import EngineConfig


@pytest.fixture
def configured() -> Iterator[None]:
    logger = logging.getLogger("pdserve")
    handlers, level = list(logger.handlers), logger.level
    yield
    logger.handlers, logger.level = handlers, level


def test_the_serve_command_prints_each_start_line_once_on_stderr(configured, capsys: pytest.CaptureFixture) -> None:
    console.configure()
    console.configure()  # as a second `serve` in one process would: still one line each
    console.worker_starting("prefill-1", EngineConfig(model="models/m", tensor_parallel_size=2))
    console.worker_ready("prefill-1", "tcp://127.0.0.1:5555", 12.345)
    console.worker_back("decode-0", "tcp://127.0.0.1:6666", 3.0, 1, 3)
    console.worker_starting("decode-0", EngineConfig(model="models/m", load_format="dummy", seed=7))
    out, err = capsys.readouterr()
    assert out == ""
    lines = [re.sub(r"^INFO \d\d-\d\d \d\d:\d\d:\d\d ", "", line) for line in err.splitlines()]
    assert lines == [
        "pdserve.startup: prefill-1: starting (prefill worker): model models/m, device cpu, tensor parallel size 2",
        "pdserve.startup: prefill-1: ready at tcp://127.0.0.1:5555 after 12.3 s",
        "pdserve.startup: decode-0: back in service at tcp://127.0.0.1:6666, 3.0 s after restart 1 of 3",
        "pdserve.startup: decode-0: starting (decode worker): model models/m (dummy weights, from seed 7), device "
        "cpu, tensor parallel size 1"], err
    logging.getLogger("pdserve.access").debug("not at INFO")
    assert capsys.readouterr().err == ""
