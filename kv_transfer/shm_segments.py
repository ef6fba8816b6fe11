"""The shm transport's shared-memory segments, as a launcher sees them: torch-free, for
the process that runs the launchers and the router."""

from __future__ import annotations

import os

import msgpack

SHM_DIR = "/dev/shm"


def unlink_segment(metadata: bytes) -> None:
    """Remove the segments an shm agent announced in `metadata` (one per TP rank), if they
    still exist: a killed process cannot unlink its own (its owner calls this after it
    is gone). Only files named as pdserve's KV segments are removed."""
    meta = msgpack.unpackb(metadata, raw=False)
    paths = meta.get("data", {}).get("paths", []) if meta.get("transport") == "shm" else []
    for path in paths:
        if isinstance(path, str) and path.startswith(os.path.join(SHM_DIR, "pdserve-kv-")) and os.path.exists(path):
            os.unlink(path)
