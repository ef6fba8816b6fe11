"""Each API key's share of a decode worker's batch (router/key_shares.py) and its place in
SLO admission (router/placement.py, admission.py): a key over its weighted share must
leave room, within their TPOT target, for the keys under theirs, so a flood with a
loose TPOT target cannot fill the batch a quiet key's tighter target needs."""

from __future__ import annotations

import time
from typing import Any

import pytest

from router.admission import LOWEST_PRIORITY, Candidate, ShareCheck, decide
from router.errors import APIError
from router.key_shares import WINDOW_S, Hold, KeyShares
from router.metrics import RouterMetrics
from router.placement import Placed, Placement, RequestPlan
from router.predictor import Prediction, _Correction
from router.routing import Ranking
from router.slo import Targets
from tests.unit.test_slo_admission import step_times
from tests.worker_stats import worker_stats

QUIET, FLOOD = 0, 1


def test_a_key_alone_or_within_its_share_is_held_to_nothing() -> None:
    shares = KeyShares([1.0, 1.0])
    assert shares.hold("d0", FLOOD, 1, 0.0) == []  # alone
    shares.opened("d0", QUIET, 2, 0.1, 0.0)
    assert shares.hold("d0", FLOOD, 1, 0.0) == []  # 1 of 3: under half
    assert shares.hold("d0", FLOOD, 2, 0.0) == []  # 2 of 4: its half
    assert KeyShares(None).hold("d0", FLOOD, 10, 0.0) == []  # no weights: no shares


def test_a_key_over_its_share_leaves_the_quiet_keys_demand_within_its_tightest_target() -> None:
    shares = KeyShares([1.0, 1.0])
    shares.opened("d0", QUIET, 1, 0.25, 0.0)
    shares.opened("d0", QUIET, 1, 0.15, 1.0)  # its peak: 2, its tightest target: 150 ms
    shares.closed("d0", QUIET, 2.0)
    shares.opened("d0", FLOOD, 2, 0.5, 2.0)
    # The flood would hold 3 of 4: the quiet key has 1 open of its demand 2 + 1 (its next).
    assert shares.hold("d0", FLOOD, 1, 3.0) == [Hold(sequences=2, tpot_s=0.15, alone=3)]
    assert shares.hold("d1", FLOOD, 1, 3.0) == []  # another worker: the quiet key is not there
    # A heavier weight is a larger share: 3 of 4 is within 3/4.
    heavy = KeyShares([1.0, 3.0])
    heavy.opened("d0", QUIET, 1, 0.15, 0.0)
    heavy.opened("d0", FLOOD, 2, 0.5, 0.0)
    assert heavy.hold("d0", FLOOD, 1, 0.0) == []
    assert heavy.hold("d0", FLOOD, 2, 0.0) != []


def test_a_key_without_a_tpot_target_or_gone_idle_is_held_for_no_longer() -> None:
    shares = KeyShares([1.0, 1.0])
    shares.opened("d0", QUIET, 1, None, 0.0)
    shares.opened("d0", FLOOD, 3, 0.5, 0.0)
    assert shares.hold("d0", FLOOD, 1, 0.0) == []  # nothing to hold it to
    shares = KeyShares([1.0, 1.0])
    shares.opened("d0", QUIET, 1, 0.15, 0.0)
    shares.opened("d0", FLOOD, 3, 0.5, 0.0)
    assert shares.hold("d0", FLOOD, 1, 1.0) != []
    shares.closed("d0", QUIET, 2.0)
    assert shares.hold("d0", FLOOD, 1, 2.0 + WINDOW_S / 2) != []  # active: it sent one lately
    assert shares.hold("d0", FLOOD, 1, 2.0 + WINDOW_S) == []  # idle for a window: holds nothing
    shares.opened("d0", QUIET, 1, 0.15, 100.0)  # back: its old peak and target are forgotten
    assert shares.hold("d0", FLOOD, 1, 100.0) == [Hold(1, 0.15, 2)]
    shares.forget("d0")  # the worker left its pool
    assert shares.hold("d0", FLOOD, 1, 100.0) == [] and "d0" not in shares._use


def test_a_refused_request_makes_its_key_active_so_the_flood_leaves_it_room() -> None:
    shares = KeyShares([1.0, 1.0])
    shares.opened("d0", FLOOD, 8, 0.5, 0.0)
    shares.wanted("d0", QUIET, 1, 0.15, 1.0)
    assert shares.hold("d0", FLOOD, 1, 1.0) == [Hold(2, 0.15, 2)]


def test_missing_only_the_share_is_a_429_over_fair_share_or_a_degrade() -> None:
    p = Prediction(0.1, 0.2, 0.1, 0.2, batch=9)
    over = Candidate("d0", 0, False, p, ShareCheck(tpot_s=0.3, target_s=0.15))
    within = Candidate("d1", 0, False, p, ShareCheck(tpot_s=0.1, target_s=0.15))
    targets = Targets(ttft_ms=1000.0, tpot_ms=500.0)
    assert decide([over, within], targets, "reject", 0.0).candidate.worker == "d1"
    with pytest.raises(APIError) as refused:
        decide([over], targets, "reject", 0.0)
    e = refused.value
    assert e.status == 429 and e.code == "over_fair_share" and e.retry_after == 1
    assert "weighted share" in str(e) and "slo_tpot_ms 150" in str(e)
    seen: list[tuple[str, str]] = []
    decision = decide([over], targets, "best_effort", 0.0, lambda d, r: seen.append((d, r)))
    assert decision.degraded and seen == [("degraded", "share")]
    with pytest.raises(APIError) as both:
        decide([over], Targets(tpot_ms=100.0), "reject", 0.0, lambda d, r: seen.append((d, r)))
    assert both.value.code == "slo_unattainable" and seen[-1] == ("rejected", "tpot_share")


# --- through the placement: a flood against a quiet key on one worker ---------------------


class OneWorker:
    """The pool, as Placement sees it: one decode worker, no prefill pool."""

    on_stats: Any = None
    on_removed: Any = None

    def ranked(self, tokens: list[int], lora: object = None) -> Ranking:
        return Ranking([("d0", 0)])

    def picked(self, name: str, ranking: Ranking, lora: object = None) -> str:
        return name

    def live_prefill(self) -> list[str]:
        return []


def placement(weights: list[float] | None, policy: str = "reject") -> Placement:
    class Slo:
        pass

    Slo.policy = policy  # type: ignore[attr-defined]

    placement = Placement(OneWorker(), RouterMetrics(), Slo(), weights)  # type: ignore[arg-type]
    # Steps take 50 ms at a batch of 1 and 10 ms more per sequence: 150 ms at 11, 500 ms at 46.
    by_requests = step_times([(1, 0.05), (64, 0.05 + 63 * 0.01)])
    placement.predictor.update("decode", "d0", worker_stats(step_seconds_by_requests=by_requests,
                                                            step_seconds_by_tokens=step_times([(1000, 0.1)])))
    return placement


QUIET_TPOT_MS, FLOOD_TPOT_MS = 155.0, 505.0  # a batch of at most 11, and of at most 46


def send(p: Placement, client: int, tpot_ms: float | None, ttft_ms: float = 100_000.0) -> Placed:
    plan = RequestPlan(0, Targets(ttft_ms=ttft_ms, tpot_ms=tpot_ms), client, time.monotonic())
    p.admit([[1] * 10], 1, plan, 10**9, False)
    return plan.placed.pop()  # sent


def flood_until_refused(p: Placement, tpot_ms: float | None = FLOOD_TPOT_MS) -> tuple[list[Placed], APIError]:
    admitted: list[Placed] = []
    for _ in range(200):
        try:
            admitted.append(send(p, FLOOD, tpot_ms))
        except APIError as e:
            return admitted, e
    raise AssertionError("the flood was never refused")


@pytest.mark.parametrize("weights", [[1.0, 1.0], None])
def test_a_flood_with_a_loose_target_leaves_the_quiet_key_its_batch(weights: list[float] | None) -> None:
    p = placement(weights)
    send(p, QUIET, QUIET_TPOT_MS)  # the quiet key is active: 1 open, its demand 2
    admitted, refusal = flood_until_refused(p)
    if weights is None:
        # No shares: the flood fills the batch up to its own target, and the quiet key's
        # next request cannot be met there.
        assert refusal.code == "slo_unattainable" and len(admitted) == 45
        with pytest.raises(APIError, match="time-per-output-token"):
            send(p, QUIET, QUIET_TPOT_MS)
        return
    # With shares the flood stops where the quiet key's next request would still meet
    # its target with SHARE_HEADROOM (20%) to spare: 1 quiet + 6 flood + 1 held for its
    # next = 8 (120 ms, within 124 ms).
    assert refusal.code == "over_fair_share" and len(admitted) == 6
    send(p, QUIET, QUIET_TPOT_MS)  # it gets in


def test_a_flood_that_filled_the_batch_first_makes_room_once_the_quiet_key_is_refused() -> None:
    p = placement([1.0, 1.0])
    admitted, refusal = flood_until_refused(p)
    assert len(admitted) == 46 and refusal.code == "slo_unattainable"  # alone: its own target is the limit
    with pytest.raises(APIError, match="time-per-output-token"):
        send(p, QUIET, QUIET_TPOT_MS)  # too full: refused, but now the quiet key is active here
    for placed in admitted[:10]:
        p.ended(placed.ticket, None, None)
    with pytest.raises(APIError) as over:  # within its own target again, but not the quiet key's
        send(p, FLOOD, FLOOD_TPOT_MS)
    assert over.value.code == "over_fair_share"
    for placed in admitted[10:36]:  # the flood drains to 10 (the quiet key's next would make 11) ...
        p.ended(placed.ticket, None, None)
    send(p, QUIET, QUIET_TPOT_MS)  # ... and the quiet key gets in


def test_a_target_no_batch_meets_holds_nothing_back() -> None:
    p = placement([1.0, 1.0])
    with pytest.raises(APIError, match="time-per-output-token"):
        send(p, QUIET, 40.0)  # under the 50 ms a step takes at a batch of 1
    admitted, refusal = flood_until_refused(p)
    assert len(admitted) == 46 and refusal.code == "slo_unattainable"


def test_a_flood_without_targets_is_held_to_its_share_all_the_same() -> None:
    p = placement([1.0, 1.0])
    send(p, QUIET, QUIET_TPOT_MS)
    plan = RequestPlan(0, Targets(), FLOOD, time.monotonic())
    admitted: list[int] = []
    with pytest.raises(APIError) as refused:
        for _ in range(200):
            p.admit([[1] * 10], 1, plan, 10**9, False)
            plan.placed.clear()
            admitted.append(1)
    assert refused.value.code == "over_fair_share" and len(admitted) == 6


def test_a_key_refused_for_ttft_alone_claims_no_room() -> None:
    p = placement([1.0, 1.0])
    for _ in range(3):  # a TTFT no worker can meet: more batch room would not help it
        with pytest.raises(APIError, match="time-to-first-token"):
            send(p, QUIET, 65.0, ttft_ms=1.0)
    admitted, refusal = flood_until_refused(p)
    assert len(admitted) == 46 and refusal.code == "slo_unattainable"


def test_a_key_with_a_target_nothing_meets_does_not_unprotect_the_others() -> None:
    p = placement([1.0, 1.0, 1.0])
    send(p, QUIET, QUIET_TPOT_MS)
    with pytest.raises(APIError, match="time-per-output-token"):
        send(p, 2, 40.0)  # active now, but its 40 ms is under a batch of 1's 50 ms
    admitted, refusal = flood_until_refused(p)
    assert refusal.code == "over_fair_share" and len(admitted) == 6  # as without it


def test_a_request_degraded_at_a_later_prompt_is_degraded_whole() -> None:
    p = placement(None, policy="best_effort")
    plan = RequestPlan(0, Targets(ttft_ms=200.0), None, time.monotonic())
    # Prefills run at 10000 tokens/s: 10 tokens meet 200 ms, 5000 do not.
    p.admit([[1] * 10, [1] * 5000], 1, plan, 10**9, False)
    assert [placed.priority for placed in plan.placed] == [LOWEST_PRIORITY] * 2
    assert [placed.ticket.order[0] for placed in plan.placed] == [LOWEST_PRIORITY] * 2
    assert len(p.predictor.tickets) == 2  # the first placement was given back


def test_a_target_the_measured_steps_meet_is_held_for_though_the_correction_says_not() -> None:
    p = placement([1.0, 1.0])
    correction = _Correction()
    correction.learn(1.5, 1.0, time.monotonic())  # completions under the flood's load: 1.5x the figures
    p.predictor._tpot["d0"] = correction
    with pytest.raises(APIError, match="time-per-output-token"):
        send(p, QUIET, 65.0)  # 75 ms predicted at a batch of 1; its demand alone measures 60 ms
    with pytest.raises(APIError) as over:  # so the flood must leave it room (before: it took the batch)
        send(p, FLOOD, None)
    assert over.value.code == "over_fair_share"
    del p.predictor._tpot["d0"]  # the correction faded: the quiet key gets in
    send(p, QUIET, 65.0)
