"""Coalescing a write's blocks into descriptors (kv_transfer/runs.py), and tcp's bound on
one descriptor's bytes (a ZMQ frame that CURVE encrypts whole)."""

from __future__ import annotations

import time

import pytest
import torch

from engine.kv_cache.layout import cache_shape
from kv_transfer import TransportConfig, WriteDone, WriteFailed, create_transport
from kv_transfer.runs import coalesce


def test_runs_are_maximal_and_bounded_when_asked() -> None:
    src, dst = list(range(10)), list(range(20, 30))
    assert coalesce(src, dst) == [(0, 20, 10)]
    assert coalesce(src, dst, max_count=4) == [(0, 20, 4), (4, 24, 4), (8, 28, 2)]
    assert coalesce([3, 2, 1], [7, 8, 9]) == [(3, 7, 1), (2, 8, 1), (1, 9, 1)]  # descending: block by block
    with pytest.raises(ValueError, match="max_count must be >= 1, got 0"):
        coalesce(src, dst, max_count=0)


@pytest.mark.timeout(60)
def test_tcp_moves_a_long_run_in_descriptors_of_at_most_a_mib() -> None:
    shape = cache_shape(num_blocks=12, num_kv_heads=2, num_layers=4, block_size=16, head_dim=512)  # 512 KiB blocks
    config = TransportConfig(timeout_s=10.0, cancel_grace_s=5.0)
    decode, prefill = create_transport("tcp", "decode", config), create_transport("tcp", "prefill", config)
    try:
        caches = []
        for t, seed in ((decode, 0), (prefill, 1)):
            cache = t.allocate_kv_cache(shape, torch.float32, "cpu")
            cache.copy_(torch.randn(shape, generator=torch.Generator().manual_seed(seed)))
            t.register_kv_cache(cache, "test-model")
            caches.append(cache)
        assert prefill.registered_compat.block_bytes == 512 << 10
        deadline = time.time() + 30
        decode.expect("r", 1, list(range(2, 10)), deadline)
        peer = prefill.add_peer(decode.metadata())
        prefill.write(peer, "r", 1, list(range(8)), list(range(2, 10)), deadline)
        end, done = time.monotonic() + 30, []
        while not done:
            assert time.monotonic() < end, "the write did not end"
            decode.poll()
            done = [e for e in prefill.poll() if isinstance(e, (WriteDone, WriteFailed))]
        assert isinstance(done[0], WriteDone), done
        assert prefill.stats["descriptors"] == 4  # 8 consecutive blocks, 2 per MiB
        assert torch.equal(caches[0][2:10], caches[1][:8])
    finally:
        prefill.close()
        decode.close()
