"""The engine and the KV transport a worker process makes from its WorkerConfig."""

from __future__ import annotations

import os

from engine.engine_core import EngineCore
from engine.model.rope import factor_set
from kv_store import StoreClient
from kv_transfer import KVTransport, create_transport
from workers.config import WorkerConfig
from workers.fault_injection import TEST_FAULTS_ENV, inject_test_faults


def engine_and_transport(config: WorkerConfig) -> tuple[EngineCore, KVTransport]:
    """The worker's engine (its cache placed where the transport reaches it) and its
    transport (the cache registered, its control socket on config.host)."""
    transport = create_transport(config.transport, config.name, config.transport_config)
    engine = shared = None
    try:
        if config.kv_store is not None:
            shared = StoreClient(config.kv_store, config.secret, config.kv_store_fetch_timeout_s,
                                 name=f"{config.name}-kv-store")
        # At TP > 1 on CPU the engine places each rank's cache in a file; the shm
        # transport's peers map those files by name, so they stay until close().
        engine = EngineCore(config.engine, transport.allocate_kv_cache, keep_cache_files=config.transport == "shm",
                            shared_kv=shared)
        register_caches(transport, engine, config.engine.model)
    except BaseException:
        # A failed start (no model, no memory) must not leave its sockets, threads and
        # rank processes behind: a zmq context left to the garbage collector can hang
        # it in term().
        transport.close()
        if engine is not None:
            engine.close()
        elif shared is not None:  # the engine owns it once made
            shared.close()
        raise
    if os.environ.get(TEST_FAULTS_ENV):
        inject_test_faults(config.name, engine, os.environ[TEST_FAULTS_ENV])
    return engine, transport


def register_caches(transport: KVTransport, engine: EngineCore, model: str) -> None:
    """The transport reaches every rank's cache, each holding its KV heads. The model's
    name carries its weights' quantization, its layers' sliding windows and its LongRoPE
    factor set: a pool quantizing to fp8 and one that does not (or attending over other
    windows, or turning keys otherwise) compute different KV, so the handshake refuses
    the pair as different models."""
    weights = engine.config.quantization or engine.model_config.quantization
    model = f"{model} [{weights} weights]" if weights else model
    # So do pools whose layers have other sliding windows; and a decode worker asks only
    # for the blocks its windows read.
    windows = engine.model_config.layer_windows
    model = f"{model} [sliding windows {','.join(map(str, windows))}]" if windows else model
    # And pools that turn keys with Phi-3's other LongRoPE factor set (picked by each
    # engine's max_model_len, engine/model/rope.py longrope_factors).
    if factors := factor_set(engine.model_config.rope_scaling, engine.max_model_len):
        model = f"{model} [longrope {factors} factors]"
    size = engine.config.tensor_parallel_size
    if size == 1:
        transport.register_kv_cache(engine.kv_cache, model, kv_scales=engine.kv_scales)
        return
    if len(engine.kv_caches) != size:
        raise ValueError(f"a tensor_parallel_size {size} worker on {engine.config.device} cannot transfer KV "
                         "yet: its driver reaches only its own rank's cache (CPU workers can)")
    transport.register_kv_cache(engine.kv_caches, model, num_kv_heads=engine.model_config.num_kv_heads,
                                head_ranges=engine.kv_head_ranges, files=engine.kv_cache_files or None,
                                kv_scales=engine.kv_scales)
