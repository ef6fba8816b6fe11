"""The P:D planner: from two load snapshots a window apart, how many prefill and decode
workers the deployment needs, and where router.remote_prefill_min_tokens should sit.

Each look (every interval_s, over the window_s before it) applies these rules, in the
spirit of DistServe's and Dynamo's planners, one step at a time:

- Decode is the bottleneck when p90 TPOT (requests that finished) or p90 time between
  streamed tokens (requests still running: seen within the window, not at their end)
  exceeds the TPOT target, the decode pool's mean KV usage exceeds kv_usage_high, or
  waiting requests per decode worker exceed queue_high: add a decode worker.
- Prefill is the bottleneck when p90 TTFT exceeds its target while decode is not (or
  while there is no prefill worker and prompts reach the threshold), or
  remote prefills in flight per prefill worker exceed prefill_jobs_high: add a prefill
  worker. (With no prefill pool allowed, prefill.max 0, or prefill workers that
  computed nothing in the window, a TTFT breach is decode's: it prefilled them all.)
  At its max, raise remote_prefill_min_tokens instead (up to min_tokens_max): to the
  window's median prompt length if that is above it (about half the prompts then go
  to the decode workers), else its upper quartile, else doubled. Once prefill is no
  longer the bottleneck and has room (below its max, or jobs per worker within half
  their limit), halve it back toward the configured value, one step per
  down-cooldown; at once if the prefill pool computed nothing in the window.
- Prediction: each pool's rate (prompt tokens the prefill workers computed per second,
  generated tokens/s for decode) is projected half a window plus one interval ahead (a
  window's mean rate is its middle's) along the line through its last few windows.
  Its per-worker capacity is the mean rate per worker of its last few bottleneck
  windows (forecast.py). When the projection needs more workers than the pool has at
  90% of that capacity, add one ("predicted_load"), before the SLO breaks.
- A pool shrinks by one after it has been calm for scale_down_cooldown_s, with every
  worker answering and the rate (now and projected) fitting one fewer. Decode: p90
  TTFT, TPOT and time between tokens within half their targets, mean KV usage below
  kv_usage_low, no queue. Prefill: p90 TTFT within half its target (unless decode is
  the bottleneck: then first tokens wait on decode), jobs per worker within half of
  prefill_jobs_high with one worker fewer, the threshold back at its configured value,
  and the last prefill worker only once it computes nothing. A window with no request
  is calm by all of these ("idle").
- Both pools together stay within max_workers: a pool that would grow past it first
  takes a worker from the other pool ("rebalance": that pool shrinks first), if the
  other is above its min, not the bottleneck, calm now and unchanged for an
  up-cooldown; otherwise it does not grow.

Never beyond a pool's [min, max]; a pool grows only scale_up_cooldown_s after its
last change (changes made by hand count too); nothing is decided before one window
has passed since the first look. decide() does no I/O: cluster/autoscale/loop.py
applies what it returns.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from cluster.autoscale.config import AutoscaleConfig
from cluster.autoscale.forecast import Capacity, Trend
from cluster.autoscale.window import Window, measure
from router.load import LoadSnapshot

POOLS = ("prefill", "decode")


@dataclass(frozen=True)
class Decision:
    pool: str  # "prefill" | "decode" | "router"
    action: str  # "up" | "down" for a pool, "set" for the router's threshold
    target: int  # the pool's new size, or the new remote_prefill_min_tokens
    # A fixed label, counted in /metrics: tpot_p90, itl_p90, kv_usage, decode_queue, ttft_p90,
    # prefill_jobs, predicted_load, within_slo, idle, rebalance, prefill_bottleneck,
    # prefill_recovered.
    reason: str
    detail: str  # the figures that led to it, for the log


class Planner:
    """Called by one thread (the loop) only; keeps what the rules need between looks:
    cooldown clocks, calm clocks, rate trends and learned capacities."""

    def __init__(self, config: AutoscaleConfig, base_min_tokens: int) -> None:
        self.config = config
        self.base_min_tokens = base_min_tokens
        self._started: float | None = None
        self._sizes: dict[str, int] = {}  # as last seen or decided
        self._changed = {name: float("-inf") for name in (*POOLS, "router")}
        self._calm_since: dict[str, float | None] = {pool: None for pool in POOLS}
        self._trends = {pool: Trend() for pool in POOLS}
        self._capacity = {pool: Capacity() for pool in POOLS}

    def decide(self, old: LoadSnapshot, new: LoadSnapshot, sizes: dict[str, int], now: float) -> list[Decision]:
        """The decisions the window from old to new calls for; `sizes`: the workers
        taking work in each pool now; `now`: time.monotonic()."""
        sizes = {pool: sizes.get(pool, 0) for pool in POOLS}
        self._observe_sizes(sizes, now)
        if self._started is None:
            self._started = now
        window = measure(old, new)
        if window is None:
            return []
        for pool in POOLS:
            self._trends[pool].add(new.at, _rate(window, pool))
        if now - self._started < self.config.window_s:
            return []
        pressure = self._pressure(window, sizes)
        self._learn(window, sizes, pressure, now)
        decisions = [d for pool in ("decode", "prefill")
                     if (d := self._pool_decision(pool, window, sizes[pool], pressure, now))]
        decisions = self._within_budget(decisions, window, sizes, pressure, now)
        router = self._router_decision(window, sizes, pressure, now)
        if router:
            decisions.append(router)
        for d in decisions:
            self._changed[d.pool] = now
            if d.pool in POOLS:
                self._sizes[d.pool] = d.target
                self._calm_since[d.pool] = None
        return decisions

    def applied(self, pool: str, now: float) -> None:
        """A decision on `pool` took effect at `now` (a new worker serves, a removed one
        left: minutes after the decision for a model that loads slowly). The pool's
        cooldown and calm clocks count from here, so that the next decision about it
        sees the change's effect, not the time it was loading."""
        self._changed[pool] = now
        if pool in POOLS:
            self._calm_since[pool] = None

    def _observe_sizes(self, sizes: dict[str, int], now: float) -> None:
        """A size other than the last seen or decided was changed by hand (or a worker
        was lost): it restarts the pool's clocks as a decision would."""
        for pool, size in sizes.items():
            if pool in self._sizes and self._sizes[pool] != size:
                self._changed[pool] = now
                self._calm_since[pool] = None
            self._sizes[pool] = size

    def _pressure(self, w: Window, sizes: dict[str, int]) -> dict[str, list[tuple[str, str]]]:
        """Per pool, the (reason, detail) of each rule that says it is the bottleneck."""
        cfg = self.config
        decode: list[tuple[str, str]] = []
        if w.tpot_p90 is not None and w.tpot_p90 > cfg.tpot_p90_s:
            decode.append(("tpot_p90", f"p90 TPOT {w.tpot_p90:.4g} s > target {cfg.tpot_p90_s:g} s"))
        if w.itl_p90 is not None and w.itl_p90 > cfg.tpot_p90_s:
            decode.append(("itl_p90", f"p90 time between tokens {w.itl_p90:.4g} s > TPOT target {cfg.tpot_p90_s:g} s"))
        if w.decode_kv is not None and w.decode_kv > cfg.kv_usage_high:
            decode.append(("kv_usage", f"decode KV usage {w.decode_kv:.0%} > {cfg.kv_usage_high:.0%}"))
        if w.decode_waiting / max(sizes["decode"], 1) > cfg.queue_high:
            decode.append(("decode_queue", f"{w.decode_waiting} requests waiting on {sizes['decode']} decode "
                                           f"worker(s) > {cfg.queue_high:g} each"))
        prefill: list[tuple[str, str]] = []
        ttft = None
        if w.ttft_p90 is not None and w.ttft_p90 > cfg.ttft_p90_s:
            ttft = ("ttft_p90", f"p90 TTFT {w.ttft_p90:.4g} s > target {cfg.ttft_p90_s:g} s")
        # The decode workers prefilled every prompt: no prefill pool allowed, one that
        # computed nothing, or none now while no prompt reached the threshold (a prefill
        # worker would get none of them).
        local = cfg.prefill.max == 0 or (w.prefill_unused if sizes["prefill"] else not w.long_prompts)
        if ttft and local:
            decode.append(ttft)
        elif ttft and (not decode or not sizes["prefill"]):
            # With no prefill worker, decode's own slowness is partly the long prompts it
            # prefills: a prefill worker takes those off it, so prefill is short too.
            prefill.append(ttft)
        if sizes["prefill"] and w.prefill_in_flight / sizes["prefill"] > cfg.prefill_jobs_high:
            prefill.append(("prefill_jobs", f"{w.prefill_in_flight} remote prefills in flight on "
                                            f"{sizes['prefill']} prefill worker(s) > {cfg.prefill_jobs_high:g} each"))
        return {"decode": decode, "prefill": prefill}

    def _learn(self, w: Window, sizes: dict[str, int], pressure: dict[str, list], now: float) -> None:
        """Capacities, from windows in which the pool's size held throughout."""
        assert self._started is not None
        for pool in POOLS:
            if now - max(self._changed[pool], self._started) < w.seconds:
                continue
            if pressure[pool]:
                self._capacity[pool].learn(_rate(w, pool), sizes[pool])
            else:
                self._capacity[pool].lift(_rate(w, pool), sizes[pool])

    def _pool_decision(self, pool: str, w: Window, size: int, pressures: dict[str, list[tuple[str, str]]],
                       now: float) -> Decision | None:
        cfg, bounds = self.config, self.config.bounds(pool)
        pressure = pressures[pool]
        since = now - self._changed[pool]
        over, change = f" over the last {w.seconds:.0f} s", f"; {pool} {size} -> "
        if pressure:
            self._calm_since[pool] = None
            if size < bounds.max and since >= cfg.scale_up_cooldown_s:
                return Decision(pool, "up", size + 1, pressure[0][0],
                                "; ".join(d for _, d in pressure) + f"{over}{change}{size + 1}")
            return None
        horizon, projected = self._projection(pool)
        needed = self._capacity[pool].workers_for(projected)
        if needed is not None and needed > size:
            self._calm_since[pool] = None
            if size < bounds.max and since >= cfg.scale_up_cooldown_s:
                return Decision(pool, "up", size + 1, "predicted_load",
                                f"{_UNITS[pool]} projected to {projected:.1f}/s in {horizon:.0f} s needs {needed} "
                                f"worker(s) at {self._capacity[pool].per_worker:.1f}/s each{change}{size + 1}")
            return None
        calm = self._calm(pool, w, size, max(projected, self._trends[pool].last), pressures)
        if not calm:
            self._calm_since[pool] = None
            return None
        calm_since = self._calm_since[pool]
        if calm_since is None:
            calm_since = self._calm_since[pool] = now
        calm_for = now - calm_since
        if size > bounds.min and calm_for >= cfg.scale_down_cooldown_s:  # a change restarts the calm clock
            reason = "idle" if w.idle else "within_slo"
            detail = "no request" if w.idle else calm
            return Decision(pool, "down", size - 1, reason,
                            f"{detail}{over}, calm for {calm_for:.0f} s{change}{size - 1}")
        return None

    def _within_budget(self, decisions: list[Decision], w: Window, sizes: dict[str, int],
                       pressure: dict[str, list], now: float) -> list[Decision]:
        """Keep both pools within max_workers: a pool that grows while the deployment is
        at it first takes a worker from the other pool, if that one can spare it (above
        its min, not the bottleneck, calm now, and not changed within an up-cooldown);
        if not, it does not grow. Shrinking goes first then, so the total never passes."""
        cap = self.config.total_max
        after = dict(sizes)
        out: list[Decision] = []
        for d in sorted(decisions, key=lambda d: d.action != "down"):
            if d.action == "up" and sum(after.values()) >= cap:
                other = "prefill" if d.pool == "decode" else "decode"
                spare = self._spare(other, w, after[other], pressure, now)
                if not spare:
                    continue
                n = after[other]
                out.append(Decision(other, "down", n - 1, "rebalance",
                                    f"{d.pool} needs a worker ({d.detail}) with {sum(after.values())} of "
                                    f"max_workers {cap} in use; {other} can spare one: {spare}; {other} {n} -> {n - 1}"))
                after[other] = n - 1
            out.append(d)
            after[d.pool] = d.target
        return out

    def _spare(self, pool: str, w: Window, size: int, pressure: dict[str, list], now: float) -> str:
        """Why `pool` can give a worker to the other now ('' if it cannot)."""
        cfg = self.config
        if size <= cfg.bounds(pool).min or pressure[pool] or now - self._changed[pool] < cfg.scale_up_cooldown_s:
            return ""
        _, projected = self._projection(pool)
        return self._calm(pool, w, size, max(projected, self._trends[pool].last), pressure)

    def _projection(self, pool: str) -> tuple[float, float]:
        """(horizon, the pool's rate projected that far): half a window plus one
        interval ahead, as a window's mean rate is its middle's."""
        horizon = self.config.window_s / 2 + self.config.interval_s
        return horizon, self._trends[pool].project(horizon)

    def _calm(self, pool: str, w: Window, size: int, rate: float, pressure: dict[str, list]) -> str:
        """Why the pool could lose a worker ('' if it could not)."""
        cfg = self.config
        if not w.all_answered or size == 0:
            return ""
        needed = self._capacity[pool].workers_for(rate)
        if needed is not None and needed > size - 1:
            return ""
        if pool == "decode":
            # Decode answers for TTFT too, unless the breach is prefill's (then a decode
            # worker may even go to prefill, under max_workers).
            prefill_ttft = _names(pressure["prefill"], "ttft_p90")
            if max(w.tpot_p90 or 0.0, w.itl_p90 or 0.0) > cfg.tpot_p90_s / 2:
                return ""
            if not prefill_ttft and (w.ttft_p90 or 0.0) > cfg.ttft_p90_s / 2:
                return ""
            if w.decode_kv is None or w.decode_kv >= cfg.kv_usage_low or w.decode_waiting:
                return ""
            return f"p90s within half their targets, decode KV usage {w.decode_kv:.0%}, no queue"
        # Prefill answers for TTFT only, and not while decode is the bottleneck (then the
        # first tokens wait on decode, and a prefill worker more would not bring them),
        # nor while it computes nothing (every prompt was short enough to stay local).
        decode_pressed, unused = bool(pressure["decode"]), w.prefill_unused
        if not decode_pressed and not unused and (w.ttft_p90 or 0.0) > cfg.ttft_p90_s / 2:
            return ""
        if w.min_tokens > self.base_min_tokens and not unused:
            return ""  # the threshold comes back first: prefill was short of workers
        if w.prefill_in_flight > cfg.prefill_jobs_high / 2 * (size - 1):
            return ""
        if size == 1 and not unused:
            return ""  # the last one goes only when it computes nothing
        latency = ("decode the bottleneck" if decode_pressed else "prefill unused" if unused
                   else "p90 TTFT within half its target")
        return (f"{latency}, {w.prefill_rate:.0f} prompt tokens/s prefilled remotely, "
                f"{w.prefill_in_flight} remote prefills in flight")

    def _router_decision(self, w: Window, sizes: dict[str, int], pressure: dict[str, list],
                         now: float) -> Decision | None:
        cfg, current = self.config, w.min_tokens
        since = now - self._changed["router"]
        # Only a backlog on the prefill workers makes prefill the bottleneck here: with
        # TTFT over target and the prefill pool idle, raising the threshold would only
        # starve it further (every prompt prefilled on the decode workers).
        busy = _names(pressure["prefill"], "prefill_jobs")
        short = busy and not pressure["decode"] and sizes["prefill"] >= cfg.prefill.max
        if short and current < cfg.min_tokens_max and since >= cfg.scale_up_cooldown_s:
            # To the window's median prompt, then its upper quartile, when above: about
            # half, then three quarters of the prompts go to the decode workers, where
            # doubling from a small threshold would take several cooldowns to reach
            # prompts of that length at all, and one doubling past them sends them all.
            above = [(math.ceil(q), name) for q, name in ((w.prompt_p50, "median"), (w.prompt_p75, "upper quartile"))
                     if q is not None and math.ceil(q) > current]
            if above:
                target, how = above[0][0], f"the {above[0][1]} prompt length ({above[0][0]} tokens)"
            else:
                target, how = current * 2, "doubled"
            target = min(target, cfg.min_tokens_max)
            return Decision("router", "set", target, "prefill_bottleneck",
                            f"{pressure['prefill'][0][1]} with prefill at its max ({cfg.prefill.max}); "
                            f"remote_prefill_min_tokens {current} -> {target}, {how}")
        if busy or current <= self.base_min_tokens:
            return None
        if w.prompt_max is None or w.prompt_max <= self.base_min_tokens:
            # No prompt of the window reached even the configured threshold: the raised one
            # has nothing to shift. Back at once, and the prefill pool may shrink.
            return Decision("router", "set", self.base_min_tokens, "prefill_recovered",
                            f"no prompt above {self.base_min_tokens} tokens in the window; "
                            f"remote_prefill_min_tokens {current} -> {self.base_min_tokens} (configured)")
        if since < cfg.scale_down_cooldown_s:
            return None
        n = sizes["prefill"]
        within = n > 0 and w.prefill_in_flight / n <= cfg.prefill_jobs_high / 2  # prefill has room
        if n < cfg.prefill.max or within:
            target = max(self.base_min_tokens, current // 2)
            room = f"prefill below its max ({n} < {cfg.prefill.max})" if n < cfg.prefill.max else \
                f"prefill within half its targets ({w.prefill_in_flight} remote prefills on {n} workers)"
            return Decision("router", "set", target, "prefill_recovered",
                            f"{room}; remote_prefill_min_tokens {current} -> {target} "
                            f"(configured {self.base_min_tokens})")
        return None


_UNITS = {"prefill": "prompt tokens prefilled remotely", "decode": "generated tokens"}


def _names(pressure: list[tuple[str, str]], reason: str) -> bool:
    """One of the pool's pressures is `reason`."""
    return any(r == reason for r, _ in pressure)


def _rate(w: Window, pool: str) -> float:
    return w.prefill_rate if pool == "prefill" else w.generation_rate
