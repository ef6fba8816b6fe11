"""The `autoscale:` section: its defaults, and every mistake named with its path, those
that need the rest of the file (a pool's replicas outside its bounds) included."""

from __future__ import annotations

import pytest

from cluster.autoscale.config import AutoscaleConfig
from cluster.config import ClusterConfig, ConfigError

BASE = {"model": "m", "prefill": {"replicas": 1}, "decode": {"replicas": 1}}


def test_absent_section_gives_defaults_with_the_planner_off() -> None:
    cfg = ClusterConfig.from_dict(BASE).autoscale
    assert cfg == AutoscaleConfig() and cfg.enabled is False
    assert (cfg.prefill.min, cfg.prefill.max, cfg.decode.min, cfg.decode.max) == (0, 8, 1, 8)
    assert AutoscaleConfig.from_dict(None) == AutoscaleConfig.from_dict({}) == cfg


def test_a_full_section_loads() -> None:
    cfg = ClusterConfig.from_dict({**BASE, "autoscale": {
        "enabled": True, "prefill": {"min": 1, "max": 3}, "decode": {"min": 1, "max": 4}, "ttft_p90_s": 1,
        "tpot_p90_s": 0.05, "kv_usage_high": 0.9, "kv_usage_low": 0.2, "queue_high": 0, "prefill_jobs_high": 2,
        "interval_s": 1, "window_s": 3, "scale_up_cooldown_s": 0, "scale_down_cooldown_s": 5,
        "drain_timeout_s": 20, "min_tokens_max": 64}}).autoscale
    assert cfg.enabled and cfg.bounds("prefill").max == 3 and cfg.bounds("decode").max == 4
    assert cfg.max_workers is None and cfg.total_max == 7  # no shared budget: the pools' maxima
    assert AutoscaleConfig.from_dict({"max_workers": 5}).total_max == 5
    assert cfg.ttft_p90_s == 1.0 and isinstance(cfg.ttft_p90_s, float) and cfg.min_tokens_max == 64
    with pytest.raises(ValueError, match="no pool 'router'"):
        cfg.bounds("router")


@pytest.mark.parametrize("section,message", [
    ({"enable": True}, "autoscale.enable: unknown key"),
    ({"enabled": "yes"}, "autoscale.enabled: must be true or false, got 'yes'"),
    ([], "autoscale: must be a mapping, got list"),
    ({"decode": {"min": 0}}, "autoscale.decode.min: must be >= 1, got 0"),
    ({"decode": {"max": 0, "min": 1}}, "autoscale.decode.max: must be >= 1, got 0"),
    ({"prefill": {"min": -1}}, "autoscale.prefill.min: must be >= 0, got -1"),
    ({"prefill": {"max": -1, "min": 0}}, "autoscale.prefill.max: must be >= 0, got -1"),
    ({"decode": {"min": 3, "max": 2}}, "autoscale.decode.max: must be >= autoscale.decode.min (3), got 2"),
    ({"decode": {"max": 2.5}}, "autoscale.decode.max: must be an integer, got 2.5"),
    ({"decode": {"maximum": 2}}, "autoscale.decode.maximum: unknown key"),
    ({"decode": 4}, "autoscale.decode: must be a mapping, got int"),
    ({"ttft_p90_s": 0}, "autoscale.ttft_p90_s: must be > 0, got 0"),
    ({"tpot_p90_s": "50ms"}, "autoscale.tpot_p90_s: must be a number, got '50ms'"),
    ({"tpot_p90_s": float("nan")}, "autoscale.tpot_p90_s: must be finite, got nan"),
    ({"kv_usage_high": 1.5}, "autoscale.kv_usage_high: must be <= 1 (a fraction of the KV blocks), got 1.5"),
    ({"kv_usage_high": 0}, "autoscale.kv_usage_high: must be > 0, got 0"),
    ({"kv_usage_low": -0.1}, "autoscale.kv_usage_low: must be >= 0, got -0.1"),
    ({"kv_usage_low": 0.9, "kv_usage_high": 0.8}, "autoscale.kv_usage_low: must be < kv_usage_high (0.8), got 0.9"),
    ({"queue_high": -1}, "autoscale.queue_high: must be >= 0, got -1"),
    ({"prefill_jobs_high": 0}, "autoscale.prefill_jobs_high: must be > 0, got 0"),
    ({"interval_s": 0}, "autoscale.interval_s: must be > 0, got 0"),
    ({"interval_s": 10, "window_s": 5}, "autoscale.window_s: must be >= interval_s (10)"),
    ({"scale_up_cooldown_s": -1}, "autoscale.scale_up_cooldown_s: must be >= 0, got -1"),
    ({"scale_down_cooldown_s": -5}, "autoscale.scale_down_cooldown_s: must be >= 0, got -5"),
    ({"drain_timeout_s": 0}, "autoscale.drain_timeout_s: must be > 0, got 0"),
    ({"min_tokens_max": 0}, "autoscale.min_tokens_max: must be >= 1, got 0"),
    ({"min_tokens_max": 100.0}, "autoscale.min_tokens_max: must be an integer, got 100.0"),
    ({"max_workers": 0}, "autoscale.max_workers: must be >= 1, got 0"),
    ({"max_workers": "3"}, "autoscale.max_workers: must be an integer, got '3'"),
    ({"max_workers": 2, "prefill": {"min": 1}, "decode": {"min": 2}},
     "autoscale.max_workers: must be >= prefill.min + decode.min (3), got 2"),
])
def test_mistakes_are_named_with_their_path(section: object, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        ClusterConfig.from_dict({**BASE, "autoscale": section})
    assert message in str(err.value)


@pytest.mark.parametrize("change,message", [
    ({"decode": {"replicas": 3}, "autoscale": {"decode": {"max": 2}}},
     "autoscale.decode.max: must be >= decode.replicas (3), got 2"),
    ({"decode": {"replicas": 1}, "autoscale": {"decode": {"min": 2}}},
     "autoscale.decode.min: must be <= decode.replicas (1), got 2"),
    ({"prefill": {"replicas": 0}, "autoscale": {"prefill": {"min": 1}}},
     "autoscale.prefill.min: must be <= prefill.replicas (0), got 1"),
    ({"prefill": {"replicas": 9}}, "autoscale.prefill.max: must be >= prefill.replicas (9), got 8"),
    ({"prefill": {"replicas": 2}, "decode": {"replicas": 2}, "autoscale": {"max_workers": 3}},
     "autoscale.max_workers: must be >= prefill.replicas + decode.replicas (4), got 3"),
    ({"router": {"remote_prefill_min_tokens": 128}, "autoscale": {"min_tokens_max": 64}},
     "autoscale.min_tokens_max: must be >= router.remote_prefill_min_tokens (128), got 64"),
])
def test_bounds_are_checked_against_the_rest_of_the_file(change: dict, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        ClusterConfig.from_dict({**BASE, **change})
    assert message in str(err.value)


def test_replicas_on_the_bounds_load() -> None:
    cfg = ClusterConfig.from_dict({**BASE, "prefill": {"replicas": 0}, "decode": {"replicas": 4},
                                   "autoscale": {"prefill": {"min": 0, "max": 0}, "decode": {"min": 4, "max": 4}}})
    assert cfg.autoscale.prefill.max == 0 and cfg.autoscale.decode.min == cfg.decode.replicas == 4
