"""Test-only fault injection for worker processes (tests/disagg/test_worker_faults.py).

Armed only by the PDSERVE_TEST_FAULTS environment variable, which nothing outside the
tests sets: it lets a test make one worker's engine fail at a chosen request, through
the worker's real failure handling.
"""

from __future__ import annotations

import logging
import time

from engine.engine_core import EngineCore

logger = logging.getLogger(__name__)

TEST_FAULTS_ENV = "PDSERVE_TEST_FAULTS"


def inject_test_faults(name: str, engine: EngineCore, spec: str) -> None:
    """Test-only (tests/disagg/test_worker_faults.py): make this worker's engine fail on
    purpose. `spec` (PDSERVE_TEST_FAULTS) is a comma-separated list of
    `worker:where:request_id`; each fires once, in the first step of `worker` that
    schedules that request:

        launch    the model's launch raises (the engine reports RequestsFailed)
        schedule  the scheduler raises once it has scheduled (EngineStateError)
        hang      the model's launch never returns (a hung kernel)
    """
    armed = set()
    for fault in filter(None, (f.strip() for f in spec.split(","))):
        worker, where, request_id = fault.split(":", 2)
        if where not in ("launch", "schedule", "hang"):
            raise ValueError(f"{TEST_FAULTS_ENV}: unknown fault {where!r} in {fault!r}")
        if worker == name:
            armed.add((where, request_id))
    if not armed:
        return
    logger.warning("%s: test faults armed (%s): %s", name, TEST_FAULTS_ENV, sorted(armed))

    def fires(where: str, scheduled) -> bool:
        for s in scheduled:
            if (where, s.request.request_id) in armed:
                armed.discard((where, s.request.request_id))
                return True
        return False

    launch, schedule = engine.runner.launch, engine.scheduler.schedule

    def faulty_launch(scheduled, *args, **kwargs):
        if fires("hang", scheduled):
            while True:
                time.sleep(1.0)
        if fires("launch", scheduled):
            raise RuntimeError(f"injected fault ({TEST_FAULTS_ENV}): the model's launch failed")
        return launch(scheduled, *args, **kwargs)

    def faulty_schedule():
        out = schedule()
        if fires("schedule", out.scheduled):
            raise RuntimeError(f"injected fault ({TEST_FAULTS_ENV}): the scheduler failed")
        return out

    # The injected faults wrap this one engine's own methods (a test-only hook).
    engine.runner.launch = faulty_launch  # type: ignore[method-assign]  # see above: wraps the bound method
    engine.scheduler.schedule = faulty_schedule  # type: ignore[method-assign]  # see above: wraps the bound method
