"""What one worker process is started with: its WorkerConfig, built by the launcher
from the cluster config (cluster/worker_configs.py). Torch-free: the launcher's process
(where the router runs) builds it without loading the engine."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.config import EngineConfig
from kv_transfer import TransportConfig
from security import DeploymentSecret

ROLES = ("decode", "prefill")


@dataclass(frozen=True)
class WorkerConfig:
    role: str  # "decode" or "prefill"
    index: int
    engine: EngineConfig
    transport: str  # kv_transfer/ name
    # timeout_s, cancel_grace_s, and host: where the worker's ZMQ and KV control sockets listen
    transport_config: TransportConfig = field(default_factory=TransportConfig)
    # No progress for this long with work to do: the worker reports stalled (None: never).
    stall_timeout_s: float | None = None
    stall_grace_s: float = 2.0  # how long a stalled worker still answers before it exits
    # decode: how long a remote prefill may take before the prompt is prefilled here
    prefill_deadline_s: float = 30.0
    # decode: remote prefills in flight per prefill worker, beyond which it prefills here
    prefill_max_outstanding: int = 16
    # The deployment's shared KV store (kv_store/): its address, None without one, and
    # how long a fetch from it may take before the blocks are computed instead.
    kv_store: str | None = None
    kv_store_fetch_timeout_s: float = 1.0

    @property
    def secret(self) -> DeploymentSecret | None:
        """The deployment's secret (security/), which the launcher put in transport_config:
        the worker's ZMQ sockets are CURVE with keys derived from it."""
        return self.transport_config.secret

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")

    @property
    def name(self) -> str:
        return f"{self.role}-{self.index}"

    @property
    def host(self) -> str:
        return self.transport_config.host
