"""The planner of a serving deployment: its loop started on the router and the
scaler, once the router serves (cluster/local/launcher.py, cluster/ray/deployment.py)."""

from __future__ import annotations

from cluster.autoscale.loop import PlannerLoop
from cluster.autoscale.planner import Decision, Planner
from cluster.config import ClusterConfig
from router.core import Router


def start_planner(config: ClusterConfig, router: Router) -> PlannerLoop | None:
    """The running planner if the config's autoscale section enables it (None if not, or
    if the router has no scaler)."""
    if not config.autoscale.enabled or router.scaler is None:
        return None
    scaler = router.scaler
    seen: dict[str, int] = {}  # the sizes the loop's current pass decides from

    def sizes() -> dict[str, int]:
        seen.update(scaler.sizes())
        return dict(seen)

    def scale(pool: str, target: int, reason: str) -> None:
        # A target is one step from what the pass saw: if a scale by hand changed the
        # pool meanwhile (scale() waits for it), the step is void, not re-aimed at a size
        # the planner never chose (ScaleError: logged, and the next pass sees the new size).
        scaler.scale(**{pool: target}, reason=f"autoscale: {reason}", expect={pool: seen[pool]})

    def record(decision: Decision) -> None:
        router.metrics.autoscale_decisions.labels(pool=decision.pool, action=decision.action,
                                                  reason=decision.reason).inc()

    control = router.control
    loop = PlannerLoop(Planner(config.autoscale, config.router.remote_prefill_min_tokens), control.snapshot, scale,
                       control.set_remote_prefill_min_tokens, record, sizes=sizes)
    loop.start()
    return loop
