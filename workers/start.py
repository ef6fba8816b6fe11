"""The engine and the KV transport a worker process makes from its WorkerConfig."""

from __future__ import annotations

import os

from engine.engine_core import EngineCore
from kv_transfer import KVTransport, create_transport
from workers.config import WorkerConfig
from workers.fault_injection import TEST_FAULTS_ENV, inject_test_faults


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
