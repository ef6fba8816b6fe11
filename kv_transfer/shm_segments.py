"""The shm transport's shared-memory segments, as a launcher sees them: torch-free, for
the process that runs the launchers and the router."""

from __future__ import annotations

import os

import msgpack

SHM_DIR = "/dev/shm"


def unlink_segment(metadata: bytes) -> None:
    """Remove the segment an shm agent announced in `metadata`, if it still exists: a
    killed process cannot unlink its own (its owner calls this after it is gone)."""
    meta = msgpack.unpackb(metadata, raw=False)
    path = meta.get("data", {}).get("path", "") if meta.get("transport") == "shm" else ""
    if path.startswith(os.path.join(SHM_DIR, "pdserve-kv-")) and os.path.exists(path):
        os.unlink(path)
