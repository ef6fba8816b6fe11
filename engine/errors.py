"""How an engine step fails, and what its caller may trust afterwards.

Two kinds, because a worker must answer them differently:

- `RequestsFailed`: the step is void and these requests were in it (or caused it). The
  engine's bookkeeping is consistent: finish those requests with the error and go on.
- `EngineStateError`: an invariant of the bookkeeping (block ownership, reference
  counts, which tokens' KV is written) is broken. Nothing the engine says can be
  trusted any more: fail every request and restart the process.

`RankFailure` is the EngineStateError of a broken tensor-parallel group: the requests
in it are not at fault and can go on elsewhere.

These are real checks, not asserts: they stay on under `python -O`, where a skipped
assert would let a request decode from blocks it does not own.
"""

from __future__ import annotations


class DoesNotFit(ValueError):
    """A request this engine can never run, whatever else runs (Scheduler.check_fits);
    `param` names the request field to change ("max_tokens", or "prompt" when the
    prompt alone is too long), as a client's 400 says it."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


class EngineStateError(RuntimeError):
    """The engine's bookkeeping broke an invariant; its state cannot be trusted."""


class RankFailure(EngineStateError):
    """A tensor-parallel collective failed: a rank died, stalled past the timeout, or
    its forward raised. The engine is unusable (its group is broken), but its requests
    did nothing wrong: a worker fails them over, as for a worker that died."""


class RequestsFailed(RuntimeError):
    """A step failed and is void; `request_ids` were in it. The caller should finish
    them with this error; every other request computes the step again next time.

    `at_fault`: the requests themselves made it fail (their parameters left nothing to
    sample), which says nothing about the device; else the model side failed with them
    in the step (which may say something about the device, if it keeps happening).
    `param`: the request parameter at fault, when one is (its error then names it, and
    the message is for the client as it is)."""

    def __init__(self, message: str, request_ids: list[str], at_fault: bool = False,
                 param: str | None = None) -> None:
        super().__init__(message)
        self.request_ids = request_ids
        self.at_fault = at_fault
        self.param = param
