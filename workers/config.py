"""What one worker process needs to start: its WorkerConfig (built by the launcher
from the cluster config, cluster/worker_configs.py), and the engine and KV transport
made from it."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from engine.config import EngineConfig
from engine.engine_core import EngineCore
from kv_transfer import KVTransport, TransportConfig, create_transport
from workers.fault_injection import TEST_FAULTS_ENV, inject_test_faults

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

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")

    @property
    def name(self) -> str:
        return f"{self.role}-{self.index}"

    @property
    def host(self) -> str:
        return self.transport_config.host


def engine_and_transport(config: WorkerConfig) -> tuple[EngineCore, KVTransport]:
    """The worker's engine (its cache placed where the transport reaches it) and its
    transport (the cache registered, its control socket on config.host)."""
    transport = create_transport(config.transport, config.name, config.transport_config)
    try:
        engine = EngineCore(config.engine, transport.allocate_kv_cache)
        transport.register_kv_cache(engine.kv_cache, config.engine.model)
    except BaseException:
        # A failed start (no model, no memory) must not leave its sockets and threads
        # behind: a zmq context left to the garbage collector can hang it in term().
        transport.close()
        raise
    if os.environ.get(TEST_FAULTS_ENV):
        inject_test_faults(config.name, engine, os.environ[TEST_FAULTS_ENV])
    return engine, transport
