"""The router's view of a decode worker's health, on a fake clock."""

from __future__ import annotations

import pytest

from router.health import WorkerHealth


def test_silence_past_the_timeout_kills_once_and_any_message_readmits() -> None:
    health = WorkerHealth(timeout_s=2.0, now=100.0)
    assert not health.expired(101.9) and health.alive
    assert not health.heard(101.9)  # a live worker's message re-admits nothing
    assert not health.expired(103.8)  # 1.9 s since it was last heard
    assert health.expired(104.0) and not health.alive
    assert not health.expired(110.0)  # declared dead once, not on every check
    assert health.heard(111.0) and health.alive  # it answers again: re-admitted
    assert not health.expired(112.5) and health.expired(113.5)


def test_a_late_timestamp_never_moves_last_heard_back() -> None:
    health = WorkerHealth(timeout_s=1.0, now=10.0)
    health.heard(12.0)
    health.heard(11.0)
    assert not health.expired(12.9)


def test_timeout_must_be_positive() -> None:
    with pytest.raises(ValueError, match="timeout_s must be > 0, got 0"):
        WorkerHealth(timeout_s=0, now=0.0)


def test_only_a_death_by_silence_marks_the_worker_silent() -> None:
    """`silent` (the local supervisor kills such a process: it may be hung): set by the
    timeout alone, cleared by any message or by a supervisor's own word."""
    health = WorkerHealth(timeout_s=1.0, now=0.0)
    assert not health.silent
    assert health.expired(1.5) and health.silent
    health.heard(2.0)
    assert not health.silent
    assert health.expired(3.5) and health.silent
    health.kill()  # its supervisor saw it exit (or it was restarted): not hung
    assert not health.silent and not health.alive


def test_a_stalled_worker_is_readmitted_only_by_a_reply_that_says_it_steps() -> None:
    """A stalled worker answers during its grace, then exits: its token batches and
    rejections are no sign that its engine steps again; a stats reply saying it is not
    stalled (its restarted process's) is."""
    health = WorkerHealth(timeout_s=2.0, now=0.0)
    assert health.stall() and not health.alive and not health.silent
    assert not health.stall()  # declared once
    assert not health.heard(0.5) and not health.alive
    assert not health.expired(10.0)  # already dead: not declared again, nor silent
    health.kill()  # its supervisor restarts it: still dead until it proves it steps
    assert not health.heard(11.0) and not health.alive
    assert health.heard(11.5, stepping=True) and health.alive and not health.stalled
    assert not health.heard(12.0) and health.alive
