"""`router.slo`: latency targets the router admits requests against (router/slo.py,
router/admission.py), validated as the config loads; docs/configs.md has a row per field.

    router:
      api_keys: [sk-interactive, sk-batch]
      slo:
        policy: reject            # reject | best_effort | off
        ttft_ms: 2000             # the deployment's default targets (null: none)
        tpot_ms: null
        key_defaults:             # per API key, by its position in api_keys; null: the deployment's
          - {ttft_ms: 500, tpot_ms: 100}
          - null
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from cluster.config_fields import ConfigError, check, checked_mapping, number
from router.slo import MAX_MS, MIN_MS, POLICIES, Targets


@dataclass(frozen=True)
class SLOConfig:
    # What the router does with a request no decode worker is predicted to serve within
    # its targets: reject (429 with Retry-After), best_effort (admit it at the lowest
    # priority) or off (admit it; the prediction is still measured).
    policy: str = "off"
    ttft_ms: float | None = None  # time to first token, from the router's receipt
    tpot_ms: float | None = None  # time per output token
    # Per API key (its position in router.api_keys): {ttft_ms, tpot_ms} or null (the
    # deployment's); a tuple of router.slo.Targets | None once loaded.
    key_defaults: Any = None

    @classmethod
    def from_dict(cls, data: Any, path: str = "router.slo", keys: int = 0) -> SLOConfig:
        """`keys`: how many API keys router.api_keys lists (key_defaults may not name more)."""
        if isinstance(data, dict) and data.get("policy") is False:  # YAML 1.1 reads a bare `off` as false
            data = {**data, "policy": "off"}
        data = checked_mapping(cls, data, path, {"policy": POLICIES})
        out = cls(**data)
        check(out.policy in POLICIES, f"{path}.policy", f"must be one of {POLICIES}, got {out.policy!r}")
        defaults = out.key_defaults if out.key_defaults is not None else []
        check(isinstance(defaults, (list, tuple)), f"{path}.key_defaults",
              f"must be a list (one entry per API key, null for the deployment's), got {defaults!r}")
        check(len(defaults) <= keys, f"{path}.key_defaults",
              f"has {len(defaults)} entries but router.api_keys lists {keys} key(s)")
        targets = tuple(_targets(d, f"{path}.key_defaults[{i}]") for i, d in enumerate(defaults))
        return cls(out.policy, _ms(out.ttft_ms, f"{path}.ttft_ms"), _ms(out.tpot_ms, f"{path}.tpot_ms"), targets)


def _ms(value: Any, path: str) -> float | None:
    if value is None:
        return None
    value = number(value, path, 0, strict=True)
    check(MIN_MS <= value <= MAX_MS, path, f"must be in [{MIN_MS:g}, {MAX_MS:.0f}] ms, got {value:g}")
    return value


def _targets(value: Any, path: str) -> Targets | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ConfigError(f"{path}: must be a mapping with ttft_ms and/or tpot_ms, or null, got {value!r}")
    unknown = sorted(set(value) - {"ttft_ms", "tpot_ms"})
    check(not unknown, f"{path}.{unknown[0] if unknown else ''}", "unknown key; known keys here: ['tpot_ms', 'ttft_ms']")
    return Targets(_ms(value.get("ttft_ms"), f"{path}.ttft_ms"), _ms(value.get("tpot_ms"), f"{path}.tpot_ms"))
