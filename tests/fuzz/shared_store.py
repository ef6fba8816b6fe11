"""The shared KV store the tier fuzzer's engines use (tests/fuzz/tiers.py): one store per
test process, kept across seeds, so that an engine finds blocks that engines of earlier
seeds (same model, other schedules: a worker restarted, or another worker) put there,
and small, so that it evicts all the time and a directory copy is often behind it.
restart() stops it and serves an empty one at the same address, mid-seed: the store lost
while engines hold a directory of it."""

from __future__ import annotations

import atexit

from kv_store import StoreClient, StoreServer

CAPACITY_BYTES = 48 * 16 * 512  # 48 blocks of 16 tokens of the tiny llama (96 of 8)
FETCH_TIMEOUT_S = 0.2
SYNC_INTERVAL_S = 0.01

_server: StoreServer | None = None


def _serve(port: int = 0) -> StoreServer:
    global _server
    _server = StoreServer(CAPACITY_BYTES, "127.0.0.1", port).start()
    return _server


def client(seed: int) -> StoreClient:
    """A client of the fuzz's store: odd seeds over TCP, even ones over the store's
    same-host socket (kv_store/local_endpoint.py), so that both paths are fuzzed."""
    server = _server if _server is not None else _serve()
    return StoreClient(server.address, None, FETCH_TIMEOUT_S, SYNC_INTERVAL_S, name="fuzz", same_host=seed % 2 == 0)


def restart() -> None:
    assert _server is not None
    port = int(_server.address.rpartition(":")[2])
    _server.stop()
    _serve(port)


@atexit.register
def _stop() -> None:
    if _server is not None:
        _server.stop()
