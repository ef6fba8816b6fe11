"""The `autoscale:` section of the cluster config (docs/configs.md has a row per field; the planner: docs/autoscale.md).

Its pool bounds hold even with the planner off: `pdserve scale` refuses a size outside
them, and the pools' starting `replicas` must lie within them (ClusterConfig checks
that, as it needs the whole file). Defaults are sized for the CPU demo deployment
(configs/local.yaml); set the SLO targets from your own.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar

from cluster.config_fields import check, checked_mapping, integer, number

DEFAULT_MAX_WORKERS = 8


@dataclass(frozen=True)
class PoolBounds:
    """How small and how large one pool may be made, by the planner or by hand."""

    FLOOR: ClassVar[int] = 0  # the fewest workers the pool can serve with at all
    min: int
    max: int

    @classmethod
    def from_dict(cls, data: Any, path: str) -> PoolBounds:
        data = checked_mapping(cls, data, path)
        out = cls(**data)
        integer(out.min, f"{path}.min", cls.FLOOR)
        integer(out.max, f"{path}.max", cls.FLOOR)
        check(out.max >= out.min, f"{path}.max", f"must be >= {path}.min ({out.min}), got {out.max}")
        return out

    def check_replicas(self, replicas: int, pool: str, path: str) -> None:
        """The pool's starting size must be one the bounds allow."""
        check(replicas >= self.min, f"{path}.min", f"must be <= {pool}.replicas ({replicas}), got {self.min}")
        check(replicas <= self.max, f"{path}.max", f"must be >= {pool}.replicas ({replicas}), got {self.max}")


@dataclass(frozen=True)
class PrefillBounds(PoolBounds):
    FLOOR: ClassVar[int] = 0  # no prefill worker (max 0: never one): decode workers prefill every prompt
    min: int = 0
    max: int = DEFAULT_MAX_WORKERS


@dataclass(frozen=True)
class DecodeBounds(PoolBounds):
    FLOOR: ClassVar[int] = 1  # someone must generate tokens
    min: int = 1
    max: int = DEFAULT_MAX_WORKERS


@dataclass(frozen=True)
class AutoscaleConfig:
    # The planner runs (cluster/autoscale/loop.py); off, the bounds still hold for `pdserve scale`.
    enabled: bool = False
    prefill: PrefillBounds = field(default_factory=PrefillBounds)
    decode: DecodeBounds = field(default_factory=DecodeBounds)
    # The most workers of both pools together (None: prefill.max + decode.max). With
    # it below that sum the pools share a budget: a pool that needs a worker while the
    # deployment is at it gets one from the other pool, if that one can spare it.
    max_workers: int | None = None
    # SLO targets over the planner's window: p90 time to first token, p90 time per
    # output token (router/metrics.py's definitions). The CPU demo model's TPOT is
    # 100-200 ms; a GPU deployment wants tens of milliseconds.
    ttft_p90_s: float = 2.0
    tpot_p90_s: float = 0.2
    # Mean KV usage of the decode pool (fraction of blocks) above high: decode needs a
    # worker; below low (and the rest calm): it can lose one.
    kv_usage_high: float = 0.85
    kv_usage_low: float = 0.3
    # Waiting requests per decode worker above this: decode needs a worker.
    queue_high: float = 2.0
    # Remote prefills in flight per prefill worker above this: prefill needs a worker.
    # A prefill step takes several prompts (max_num_batched_tokens); more than a few
    # per worker means prompts queue there.
    prefill_jobs_high: float = 4.0
    # The planner looks every interval_s at the window_s before (its p90s and rates);
    # a pool grows only scale_up_cooldown_s after its last change, and shrinks only after
    # scale_down_cooldown_s well inside every target. The up-cooldown should be at
    # least a window, so that a decision sees its previous one's effect.
    interval_s: float = 10.0
    window_s: float = 30.0
    scale_up_cooldown_s: float = 30.0
    scale_down_cooldown_s: float = 120.0
    # A draining worker's requests that have not finished within this fail over to
    # another worker (cluster/elastic.py), so scale-down never waits forever.
    drain_timeout_s: float = 60.0
    # When prefill is the bottleneck at its max, the planner raises
    # router.remote_prefill_min_tokens (doubling) up to this, so more short prompts are
    # prefilled on the decode workers; it comes back toward the configured value after.
    min_tokens_max: int = 1024

    @classmethod
    def from_dict(cls, data: Any, path: str = "autoscale") -> AutoscaleConfig:
        data = checked_mapping(cls, {} if data is None else data, path)
        out = cls(**{**data, "prefill": PrefillBounds.from_dict(data.get("prefill", {}), f"{path}.prefill"),
                     "decode": DecodeBounds.from_dict(data.get("decode", {}), f"{path}.decode")})
        # dict[str, Any]: handed to dataclasses.replace by field name below.
        seconds: dict[str, Any] = {name: number(getattr(out, name), f"{path}.{name}", 0, strict=True)
                   for name in ("ttft_p90_s", "tpot_p90_s", "interval_s", "window_s", "drain_timeout_s")}
        seconds.update({name: number(getattr(out, name), f"{path}.{name}", 0)
                        for name in ("scale_up_cooldown_s", "scale_down_cooldown_s")})
        check(seconds["window_s"] >= seconds["interval_s"], f"{path}.window_s",
              f"must be >= interval_s ({seconds['interval_s']:g}): each look covers at least the time since the "
              f"last, got {seconds['window_s']:g}")
        high = number(out.kv_usage_high, f"{path}.kv_usage_high", 0, strict=True)
        check(high <= 1, f"{path}.kv_usage_high", f"must be <= 1 (a fraction of the KV blocks), got {high:g}")
        low = number(out.kv_usage_low, f"{path}.kv_usage_low", 0)
        check(low < high, f"{path}.kv_usage_low", f"must be < kv_usage_high ({high:g}), got {low:g}")
        queue = number(out.queue_high, f"{path}.queue_high", 0)
        jobs = number(out.prefill_jobs_high, f"{path}.prefill_jobs_high", 0, strict=True)
        integer(out.min_tokens_max, f"{path}.min_tokens_max", 1)
        if out.max_workers is not None:
            integer(out.max_workers, f"{path}.max_workers", 1)
            fewest = out.prefill.min + out.decode.min
            check(out.max_workers >= fewest, f"{path}.max_workers",
                  f"must be >= prefill.min + decode.min ({fewest}), got {out.max_workers}")
        return dataclasses.replace(out, kv_usage_high=high, kv_usage_low=low, queue_high=queue,
                                   prefill_jobs_high=jobs, **seconds)

    def bounds(self, pool: str) -> PoolBounds:
        """The bounds of pool "prefill" or "decode"."""
        if pool not in ("prefill", "decode"):
            raise ValueError(f"no pool {pool!r}: 'prefill' or 'decode'")
        return getattr(self, pool)

    @property
    def total_max(self) -> int:
        """The most workers of both pools together."""
        return self.prefill.max + self.decode.max if self.max_workers is None else self.max_workers

    def check_cluster(self, replicas: dict[str, int], remote_prefill_min_tokens: int, path: str = "autoscale") -> None:
        """What needs the rest of the file: each pool's starting replicas within its
        bounds and together within max_workers, and room above the router's configured
        remote-prefill threshold."""
        for pool in ("prefill", "decode"):
            self.bounds(pool).check_replicas(replicas[pool], pool, f"{path}.{pool}")
        total = replicas["prefill"] + replicas["decode"]
        check(total <= self.total_max, f"{path}.max_workers",
              f"must be >= prefill.replicas + decode.replicas ({total}), got {self.total_max}")
        check(self.min_tokens_max >= remote_prefill_min_tokens, f"{path}.min_tokens_max",
              f"must be >= router.remote_prefill_min_tokens ({remote_prefill_min_tokens}), got {self.min_tokens_max}")
