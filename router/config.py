"""What the router is configured with: its own settings and the limits of the model its
decode workers serve. The launcher (cluster/serve.py) builds both; the router imports
nothing from cluster/ (arrows point down) and no torch, so these are a protocol and a
record of plain numbers rather than the cluster config or an engine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from engine.config import EngineConfig
from engine.model.config import ModelConfig, max_model_len
from router.bounds import BoundSettings
from router.limits import LimitSettings
from router.slo import SLOSettings


class GuardSettings(Protocol):
    """The fields router/http_guard.py reads: whether /metrics needs a key, and a
    request body's bytes and time."""

    @property
    def metrics_need_key(self) -> bool: ...

    @property
    def max_body_bytes(self) -> int: ...

    @property
    def body_timeout_s(self) -> float: ...


class RouterSettings(GuardSettings, BoundSettings, LimitSettings, Protocol):
    """The router's section of the cluster config (cluster/router_config.py, where each
    field is validated and documented): the fields the router reads, those of its gate
    (GuardSettings), of what a body may hold (router/bounds.py) and of the per-key
    limits (router/limits.py) among them."""

    @property
    def policy(self) -> str: ...  # router/routing.py

    @property
    def remote_prefill_min_tokens(self) -> int: ...

    @property
    def max_queued_requests(self) -> int: ...

    @property
    def health_interval_s(self) -> float: ...

    @property
    def worker_timeout_s(self) -> float: ...

    @property
    def tool_call_parser(self) -> str: ...  # router/tool_parsers.py

    @property
    def access_log(self) -> bool: ...  # a line per request (router/access_log.py)

    # The served model's names (router/model_names.py); None: its path.
    @property
    def served_model_name(self) -> tuple[str, ...] | None: ...

    # The API keys (router/auth.py); none: every caller is served.
    @property
    def api_keys(self) -> tuple[str, ...] | None: ...

    # The admin keys (router/admin.py); none: the admin endpoints are off.
    @property
    def admin_keys(self) -> tuple[str, ...] | None: ...

    # Fair queuing's weight per API key (router/fair_queue.py); None: FCFS.
    @property
    def key_weights(self) -> tuple[float, ...] | None: ...

    # SLO-aware admission (router/slo.py, router/admission.py); None: off, no default targets.
    @property
    def slo(self) -> SLOSettings | None: ...


@dataclass(frozen=True)
class ModelLimits:
    """The served model and the limits of the decode workers' engines, as the router
    must know them to check a request before any worker sees it."""

    model: str  # the model directory (its tokenizer is loaded from there); also the served name
    max_model_len: int  # the decode workers' context length, computed as their engines do
    vocab_size: int  # prompt token ids must be below this
    block_size: int  # KV block size, for the kv_aware index and the KV pools' token counts
    # The decode workers' KV pool size when the config fixes it; None: each profiles its
    # own (the router then learns it from their stats replies).
    num_kv_blocks: int | None
    # The decode workers' LoRA rank limit (engine max_lora_rank); None: they run without LoRA.
    max_lora_rank: int | None = None

    @classmethod
    def of(cls, engine: EngineConfig) -> ModelLimits:
        """The limits of a decode worker's engine with this config (its model directory's
        config.json read, no weights loaded)."""
        model_config = ModelConfig.from_model_dir(engine.model)
        return cls(model=engine.model, max_model_len=max_model_len(engine, model_config),
                   vocab_size=model_config.vocab_size, block_size=engine.block_size,
                   num_kv_blocks=engine.num_kv_blocks,
                   max_lora_rank=engine.max_lora_rank if engine.enable_lora else None)
