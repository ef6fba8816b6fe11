"""SLO-aware admission and routing: which decode worker takes a request, given its
latency targets (router/slo.py) and each candidate's predicted latency
(router/predictor.py).

Among the candidates (live decode workers not draining, in the routing policy's order
of preference: router/routing.py), those predicted to meet every target of the request
are feasible (and, for a key over its weighted share of a worker's batch, leave what
router/key_shares.py holds there for the keys under theirs); the one with the most
headroom wins (headroom: the least, over its targets and the share, of 1 - predicted /
target, in steps of HEADROOM_STEP so that near-equal candidates tie), and the policy's
order breaks ties (kv_aware: the one with the most of the prompt cached). A candidate
whose figures are unknown yet (no stats reply, no step) is feasible with full headroom:
a new worker must get work to be measured.

When none is feasible, `router.slo.policy` says what happens:
- `reject`: HTTP 429 naming the target missed and the prediction, with Retry-After
  the seconds the best candidate's queue needs to drain by that much (code
  slo_unattainable), or, missing only the share, naming the share (code
  over_fair_share, Retry-After 1 s);
- `best_effort`: admitted at the lowest priority (after every request that may meet
  its targets, and preempted first), on the policy's first choice;
- `off`: targets are not acted on (the prediction is still made and measured).
A request without targets goes to the policy's first choice, unless its key is over its
share of that worker's batch (then it is held to the share like any other).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from router.errors import APIError
from router.limits import retry_after
from router.predictor import Prediction
from router.slo import Targets

HEADROOM_STEP = 0.1
# A key over its share must leave the keys it holds for this much of their TPOT target
# spare: the prediction's correction moves with load, and their next request must still
# be admitted when it rises a little (else they are refused while the flood's requests run).
SHARE_HEADROOM = 0.2
LOWEST_PRIORITY = 2**63 - 1  # the protocol's largest priority: scheduled last


@dataclass(frozen=True)
class ShareCheck:
    """A key over its share on a candidate: the TPOT predicted there with what it must
    leave free (router/key_shares.py Hold), against the target held for."""

    tpot_s: float
    target_s: float

    @property
    def limit_s(self) -> float:
        """What the TPOT predicted with the hold must stay within: the target less
        SHARE_HEADROOM of it."""
        return self.target_s * (1 - SHARE_HEADROOM)


@dataclass(frozen=True)
class Candidate:
    worker: str
    cached: int  # prompt tokens it probably holds
    remote: bool  # its prefill would go to the prefill pool
    prediction: Prediction
    share: ShareCheck | None = None  # None: its key is within its share there (or nothing is held)


@dataclass(frozen=True)
class Decision:
    candidate: Candidate
    degraded: bool  # best_effort: admitted at the lowest priority
    reason: str  # why admitted or degraded: met, no_slo, unknown, off; else what is missed (_miss_reason)


def misses(c: Candidate, targets: Targets, elapsed_s: float) -> tuple[bool, bool, bool]:
    """Whether the prediction misses the TTFT target (what is left of it after
    `elapsed_s` already spent), the TPOT target, and what its key must leave free."""
    p = c.prediction
    ttft = targets.ttft_ms is not None and p.ttft_s is not None and elapsed_s + p.ttft_s > targets.ttft_ms / 1000
    tpot = targets.tpot_ms is not None and p.tpot_s is not None and p.tpot_s > targets.tpot_ms / 1000
    share = c.share is not None and c.share.tpot_s > c.share.limit_s
    return ttft, tpot, share


def _headroom(c: Candidate, targets: Targets, elapsed_s: float) -> float:
    p = c.prediction
    room = [1.0]
    if targets.ttft_ms is not None and p.ttft_s is not None:
        room.append(1 - (elapsed_s + p.ttft_s) / (targets.ttft_ms / 1000))
    if targets.tpot_ms is not None and p.tpot_s is not None:
        room.append(1 - p.tpot_s / (targets.tpot_ms / 1000))
    if c.share is not None:
        room.append(1 - c.share.tpot_s / c.share.limit_s)
    return min(room)


def _miss_reason(ttft: bool, tpot: bool, share: bool) -> str:
    """ttft, tpot, share, or those missed joined by "_" (ttft_tpot, tpot_share, ...)."""
    return "_".join(name for name, missed in (("ttft", ttft), ("tpot", tpot), ("share", share)) if missed)


def decide(candidates: Sequence[Candidate], targets: Targets, policy: str, elapsed_s: float,
           count: Callable[[str, str], None] = lambda decision, reason: None) -> Decision:
    """The candidate to send the request to (module doc); APIError 429 when policy is
    reject and none is predicted to meet the targets. `candidates`: best first by the
    routing policy, at least one. count(decision, reason): the admission metrics."""
    first = candidates[0]
    if policy == "off":
        reason = "no_slo" if not targets.any else "off"
        count("admitted", reason)
        return Decision(first, False, reason)
    # Without targets, only a key's share of the batch can refuse a request.
    feasible = [c for c in candidates if not any(misses(c, targets, elapsed_s))]
    if feasible:
        best = max(feasible, key=lambda c: round(_headroom(c, targets, elapsed_s) / HEADROOM_STEP))
        p = best.prediction
        known = (targets.ttft_ms is None or p.ttft_s is not None) and (targets.tpot_ms is None or p.tpot_s is not None)
        reason = "no_slo" if not targets.any else "met" if known else "unknown"
        count("admitted", reason)
        return Decision(best, False, reason)
    nearest = max(candidates, key=lambda c: _headroom(c, targets, elapsed_s))
    ttft, tpot, share = misses(nearest, targets, elapsed_s)
    reason = _miss_reason(ttft, tpot, share)
    if policy == "best_effort":
        count("degraded", reason)
        return Decision(first, True, reason)
    count("rejected", reason)
    if share and not (ttft or tpot):
        assert nearest.share is not None
        raise _over_share(nearest.share)
    raise _rejection(nearest.prediction, targets, elapsed_s, ttft)


def _over_share(check: ShareCheck) -> APIError:
    message = ("this request's API key holds more than its weighted share (router.key_weights) of the decode "
               "workers' batches, and taking more would leave the other keys' tokens about "
               f"{check.tpot_s * 1000:.0f} ms apart, over {check.limit_s * 1000:g} ms "
               f"({100 - SHARE_HEADROOM * 100:g}% of their slo_tpot_ms {check.target_s * 1000:g}); retry later")
    return APIError(429, message, None, kind="rate_limit_error", code="over_fair_share", retry_after=retry_after(1.0))


def _rejection(p: Prediction, targets: Targets, elapsed_s: float, ttft: bool) -> APIError:
    if ttft:
        assert p.ttft_s is not None and targets.ttft_ms is not None
        over = elapsed_s + p.ttft_s - targets.ttft_ms / 1000
        message = (f"the server is predicted to miss this request's time-to-first-token SLO "
                   f"(slo_ttft_ms {targets.ttft_ms:g}): its first token would take about "
                   f"{(elapsed_s + p.ttft_s) * 1000:.0f} ms on the best decode worker; retry later "
                   "or with a looser slo_ttft_ms")
        wait = over
    else:
        assert p.tpot_s is not None and targets.tpot_ms is not None
        message = (f"the server is predicted to miss this request's time-per-output-token SLO "
                   f"(slo_tpot_ms {targets.tpot_ms:g}): its tokens would come about {p.tpot_s * 1000:.0f} ms "
                   "apart on the best decode worker; retry later or with a looser slo_tpot_ms")
        wait = 1.0
    return APIError(429, message, "slo_ttft_ms" if ttft else "slo_tpot_ms", kind="rate_limit_error",
                    code="slo_unattainable", retry_after=retry_after(wait))
