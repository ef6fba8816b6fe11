"""WorkerStats for tests' fake workers: the figures both roles must report, at zero."""

from __future__ import annotations

from typing import Any

from protocol import Histogram, WorkerStats


def empty_histogram() -> Histogram:
    return Histogram(bounds=[1.0], counts=[0, 0], sum=0.0, count=0)


def worker_stats(**fields: Any) -> WorkerStats:
    """A worker that has done nothing yet, but for `fields` (WorkerStats' own)."""
    zeros: dict[str, Any] = dict(name="fake", num_blocks=0, free_blocks=0, running=0, waiting=0, preemptions=0,
                                 ranks=[], refused_peers=0, stalled=False, no_progress_s=0.0,
                                 step_seconds=empty_histogram(), step_requests=empty_histogram(),
                                 step_tokens=empty_histogram())
    return WorkerStats(**{**zeros, **fields})
