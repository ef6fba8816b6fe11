"""The router's section of the cluster config (`router:`), validated as it loads: where
it listens and for whom (API keys), how it routes and supervises the workers, and what
a request may hold (docs/configs.md has a row per field)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from cluster.api_keys import is_loopback, resolve_api_keys
from cluster.config_fields import ConfigError, check, checked_mapping, integer, number
from cluster.slo_config import SLOConfig
from router.tool_parsers import TOOL_PARSERS

POLICIES = ("round_robin", "least_loaded", "kv_aware")
MAX_WEIGHT_RATIO = 1e6  # router.key_weights: the largest over the smallest
MIN_WEIGHT = 1e-3  # router.key_weights: the smallest weight


@dataclass(frozen=True)
class RouterConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    policy: str = "kv_aware"
    # A request goes to the prefill pool only when this many prompt tokens are not
    # already cached on its decode worker (conditional disaggregation).
    remote_prefill_min_tokens: int = 64
    max_queued_requests: int = 256  # beyond: HTTP 429
    # A decode worker sends at most this many remote prefills to one prefill worker at
    # a time; past it (the pool is saturated) it prefills locally instead.
    prefill_max_outstanding: int = 16
    # Decode-worker supervision (router/health.py): a `stats` ping every
    # health_interval_s; a worker silent (no tokens, no ping reply) for worker_timeout_s
    # is dead: no new requests, and its requests fail over to a live worker. The
    # timeout must exceed the longest engine step (a long prefill, a first-use kernel
    # compile), or a busy worker is taken for dead (harmless but wasteful: its requests
    # move, and it is re-admitted at its next reply).
    health_interval_s: float = 1.0
    worker_timeout_s: float = 10.0
    # A worker (either pool) with work in its engine's queues whose steps compute no
    # token for this long is stalled: its stats replies say so (the router fails its
    # requests over), and it exits to be restarted (workers/loop.py). So does one
    # whose loop does not come round for this long (a step that never returns). Must
    # exceed the longest engine step, and worker_timeout_s. None or 0: off.
    stall_timeout_s: float | None = 60.0
    # How the served model writes a tool call, read back out of its text when a request
    # with tools lets it choose (tool_choice "auto"): router/tool_parsers.py.
    tool_call_parser: str = "hermes"
    # A line per request on the `pdserve.access` logger (router/access_log.py).
    access_log: bool = True
    # The names /v1/models lists and a request's `model` may give (router/model_names.py):
    # a string or a list of aliases, the first the one responses carry; null: the model path.
    served_model_name: Any = None
    # API keys (cluster/api_keys.py: a list, "env:NAME" or "file:PATH"), a tuple once
    # loaded, never in a repr; router/http_guard.py checks them. Serving a non-loopback
    # host without keys must be asked for (allow_unauthenticated).
    api_keys: Any = field(default=None, repr=False)
    # Admin keys, spelt as api_keys are: the /admin/ endpoints (router/admin.py: scale
    # the pools) need one of them; null: those endpoints are off.
    admin_keys: Any = field(default=None, repr=False)
    metrics_need_key: bool = True
    allow_unauthenticated: bool = False
    # Input bounds (docs/configs.md says why each default): body bytes (413) and arrival
    # time (408), chat messages, `stop` entries, characters of strings the context length
    # does not bound (400 each), requests waiting for the tokenizer (429).
    max_body_bytes: int = 8 * 1024 * 1024
    body_timeout_s: float = 30.0
    max_messages: int = 2048
    max_stop: int = 64
    max_string_chars: int = 65536
    max_tokenize_queue: int = 64
    # Parallel sampling: n and best_of at most max_n (400 naming the field), and a
    # request's prompts x best_of (or n) at most max_sequences (400 naming prompt).
    max_n: int = 16
    max_sequences: int = 256
    # Per-key limits (router/limits.py), off when null: requests per second (a bucket of
    # key_burst, default one second's worth) and tokens in flight (prompt + max_tokens of
    # the key's running requests). Without api_keys every caller counts as one key.
    key_requests_per_s: float | None = None
    key_burst: int | None = None
    key_tokens_in_flight: int | None = None
    # Weighted fair queuing across API keys (router/fair_queue.py): one weight per key of
    # api_keys, in order; a key's share of the queues is its weight over the sum. null:
    # arrival order (FCFS) for everyone.
    key_weights: Any = None
    # SLO-aware admission (cluster/slo_config.py: policy, default and per-key targets).
    slo: SLOConfig = field(default_factory=SLOConfig)

    @classmethod
    def from_dict(cls, data: Any, path: str = "router") -> RouterConfig:
        data = checked_mapping(cls, data, path, {"policy": POLICIES, "tool_call_parser": tuple(TOOL_PARSERS)})
        for name in ("api_keys", "admin_keys"):
            try:
                data = {**data, name: resolve_api_keys(data.get(name)) or None}
            except ValueError as exc:
                raise ConfigError(f"{path}.{name}: {exc}") from None
        out = cls(**data)
        served = _served_model_names(out.served_model_name, f"{path}.served_model_name")
        check(isinstance(out.host, str) and out.host != "", f"{path}.host", f"must be a host name, got {out.host!r}")
        integer(out.port, f"{path}.port", 0, 65535)
        check(out.policy in POLICIES, f"{path}.policy", f"must be one of {POLICIES}, got {out.policy!r}")
        check(out.tool_call_parser in TOOL_PARSERS, f"{path}.tool_call_parser",
              f"must be one of {tuple(TOOL_PARSERS)}, got {out.tool_call_parser!r}")
        integer(out.remote_prefill_min_tokens, f"{path}.remote_prefill_min_tokens", 1)
        integer(out.max_queued_requests, f"{path}.max_queued_requests", 1)
        integer(out.prefill_max_outstanding, f"{path}.prefill_max_outstanding", 1)
        interval = number(out.health_interval_s, f"{path}.health_interval_s", 0, strict=True)
        timeout = number(out.worker_timeout_s, f"{path}.worker_timeout_s", 0, strict=True)
        check(timeout > interval, f"{path}.worker_timeout_s",
              f"must be > health_interval_s ({interval:g}), or a live worker between pings is taken "
               f"for dead; got {timeout:g}")
        stall = out.stall_timeout_s
        if stall is not None:
            stall = number(stall, f"{path}.stall_timeout_s", 0)
            check(stall == 0 or stall > timeout, f"{path}.stall_timeout_s",
                  f"must be > worker_timeout_s ({timeout:g}), which is sized to exceed the longest engine step "
                   f"(a worker in a long step would be taken for hung), or 0 (off); got {stall:g}")
        check(out.api_keys is not None or out.allow_unauthenticated or is_loopback(out.host),
              f"{path}.allow_unauthenticated", f"must be true to serve {path}.host {out.host!r} (not a loopback "
               f"address: other machines reach it) without {path}.api_keys; set api_keys (e.g. 'env:PDSERVE_API_KEYS') "
               "or, to serve anyone who reaches the port, allow_unauthenticated: true")
        for name in ("max_body_bytes", "max_messages", "max_stop", "max_string_chars", "max_tokenize_queue",
                     "max_n", "max_sequences", "key_burst", "key_tokens_in_flight"):
            if getattr(out, name) is not None:  # only the key_* ones may be
                integer(getattr(out, name), f"{path}.{name}", 1)
        check(out.max_sequences >= out.max_n, f"{path}.max_sequences",
              f"must be >= max_n ({out.max_n}): one prompt may sample max_n sequences; got {out.max_sequences}")
        shared = set(out.api_keys or ()) & set(out.admin_keys or ())
        check(not shared, f"{path}.admin_keys", "must not repeat a key of api_keys (a client of the model could "
              "then scale the deployment)")
        rate = out.key_requests_per_s
        rate = None if rate is None else number(rate, f"{path}.key_requests_per_s", 0, strict=True)
        check(rate is not None or out.key_burst is None, f"{path}.key_burst",
              "needs key_requests_per_s (the rate its bucket refills at)")
        keys = len(out.api_keys or ())
        slo = SLOConfig.from_dict(data.get("slo") or {}, f"{path}.slo", keys)
        return dataclasses.replace(out, key_weights=_key_weights(out.key_weights, f"{path}.key_weights", keys), slo=slo,
                                   health_interval_s=interval, worker_timeout_s=timeout,
                                   stall_timeout_s=stall or None, key_requests_per_s=rate, served_model_name=served,
                                   body_timeout_s=number(out.body_timeout_s, f"{path}.body_timeout_s", 0, strict=True))


def _key_weights(value: Any, path: str, keys: int) -> tuple[float, ...] | None:
    """One positive weight per API key, as a tuple (None: not set)."""
    if value is None:
        return None
    check(isinstance(value, list), path, f"must be a list of weights, one per key of api_keys in order, got {value!r}")
    check(keys > 0, path, "needs router.api_keys (fair queuing shares the queues among API keys)")
    check(len(value) == keys, path, f"must be a list of {keys} weight(s), one per key of api_keys in order, "
          f"got {len(value)}")
    weights = tuple(number(w, f"{path}[{i}]", 0, strict=True) for i, w in enumerate(value))
    # A weight far below the others, or tiny, would send its key's tags (cost / weight) past any float.
    check(min(weights) >= MIN_WEIGHT, path, f"every weight must be at least {MIN_WEIGHT:g}, got {value!r}")
    check(max(weights) / min(weights) <= MAX_WEIGHT_RATIO, path,
          f"the largest weight must be at most {MAX_WEIGHT_RATIO:g} times the smallest, got {value!r}")
    return weights


def _served_model_names(value: Any, path: str) -> tuple[str, ...] | None:
    """served_model_name as a tuple of distinct non-empty names (None: not set)."""
    if value is None:
        return None
    names = [value] if isinstance(value, str) else value
    check(isinstance(names, (list, tuple)) and len(names) > 0, path,
          f"must be a name or a non-empty list of names, got {value!r}")
    for i, name in enumerate(names):
        where = path if isinstance(value, str) else f"{path}[{i}]"
        check(isinstance(name, str) and name.strip() == name and name != "", where,
              f"must be a non-empty string without leading or trailing spaces, got {name!r}")
        check(name not in names[:i], where, f"{name!r} is listed twice")
    return tuple(names)
