"""How long each worker's loop may wait for a message before stepping again. Work a
step can advance: not at all. Work that only waits on another process (a decode
worker's prompts being prefilled remotely, a prefill worker's writes awaiting their
acknowledgement): briefly, never 0, or on a 2-core machine the waiting worker spins a
core away from the one it waits on (issue 22's benchmark: the decode worker's spin
slowed its prefill worker). Nothing: the idle wait."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from decode_worker.server import DecodeWorker
from engine.config import EngineConfig
from engine.engine_core import EngineCore
from prefill_worker.server import PrefillWorker
from workers.loop import IDLE_POLL_MS, WAIT_POLL_MS


class FakeEngine:
    """An engine's two questions: something a step advances, something unfinished."""

    def __init__(self) -> None:
        self.runnable = self.unfinished = False

    def has_runnable(self) -> bool:
        return self.runnable

    def has_unfinished(self) -> bool:
        return self.unfinished

    def collect_kv_events(self, max_per_block: int) -> None:
        pass


@pytest.mark.parametrize("runnable, unfinished, expected", [
    (True, True, 0),  # running or queued requests: step at once
    (False, True, WAIT_POLL_MS),  # every request waits for its prompt's KV
    (False, False, IDLE_POLL_MS),
])
def test_decode_worker_waits_briefly_when_its_requests_only_wait_for_kv(
        runnable: bool, unfinished: bool, expected: int) -> None:
    engine = FakeEngine()
    engine.runnable, engine.unfinished = runnable, unfinished
    worker = DecodeWorker("decode-test", SimpleNamespace(engine=engine))
    try:
        assert worker.busy() == unfinished  # the loop still counts it busy (no idle health check)
        assert worker.poll_ms() == expected
    finally:
        worker.close()


@pytest.mark.parametrize("runnable, jobs, expected", [
    (True, {"r": object()}, 0),  # prompts to compute
    (False, {"r": object()}, WAIT_POLL_MS),  # computed; their writes await acknowledgement
    (False, {}, IDLE_POLL_MS),
])
def test_prefill_worker_waits_briefly_when_its_jobs_only_wait_for_acks(
        runnable: bool, jobs: dict, expected: int) -> None:
    engine = FakeEngine()
    engine.runnable = runnable
    worker = PrefillWorker("prefill-test", SimpleNamespace(engine=engine, jobs=jobs))
    try:
        assert worker.poll_ms() == expected
    finally:
        worker.close()


def test_wait_poll_is_short_but_not_a_spin() -> None:
    assert 0 < WAIT_POLL_MS < IDLE_POLL_MS


def test_a_launched_async_step_is_runnable(llama_dir: Path) -> None:
    """An async step in flight is collected by the next step, whatever else waits."""
    engine = EngineCore(EngineConfig(model=str(llama_dir), num_kv_blocks=16, async_scheduling=True))
    assert not engine.has_runnable()
    engine._in_flight = object()  # type: ignore[assignment]  # as step() leaves it under async scheduling
    try:
        assert engine.has_runnable()
    finally:
        engine._in_flight = None
