"""One request prefilled by one engine and decoded by another, over a real transport in
one process: what the fp8 and sliding-window benchmarks measure a remote prefill by."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from decode_worker.remote_kv import DecodeWorkerCore
from engine import SamplingParams
from engine.config import EngineConfig
from engine.engine_core import EngineCore
from kv_transfer import TransportConfig, create_transport
from prefill_worker.remote_prefill import PrefillWorkerCore
from workers.start import register_caches


def push_one(model: str | Path, transport: str, prompt: list[int], params: SamplingParams,
             **engine: Any) -> tuple[int, list[int]]:
    """(bytes the prefill side wrote, the decoded tokens); `engine`: both engines'
    EngineConfig options besides the model. Fails if the request did not go remote,
    fell back to a local prefill, or did not finish within 120 s."""
    config = TransportConfig(timeout_s=10.0, cancel_grace_s=5.0)
    t_dec, t_pre = create_transport(transport, "decode", config), create_transport(transport, "prefill", config)
    engines: list[EngineCore] = []
    try:
        for t in (t_dec, t_pre):
            engines.append(EngineCore(EngineConfig(model=str(model), **engine), t.allocate_kv_cache,
                                      keep_cache_files=transport == "shm"))
            register_caches(t, engines[-1], "bench")
        t_pre.add_peer(t_dec.metadata())
        decode, prefill = DecodeWorkerCore(engines[0], t_dec, 30.0), PrefillWorkerCore(engines[1], t_pre)
        pushed = decode.add_request("r0", prompt, params, remote=True, sender="prefill")
        assert pushed is not None, "the request did not go to remote prefill"
        prefill.submit(pushed)
        out = None
        end = time.monotonic() + 120
        while out is None:
            assert time.monotonic() < end, "the remote prefill did not finish"
            for result in prefill.step():
                assert result.error is None, result.error
            finished = decode.step().finished
            out = list(finished[0].output_token_ids) if finished else None
        assert decode.stats["remote"] == 1 and decode.stats["fallbacks"] == 0, decode.stats
        return int(t_pre.stats["bytes_written"]), out
    finally:
        for t in (t_pre, t_dec):
            t.close()
        for core in engines:
            core.close()
