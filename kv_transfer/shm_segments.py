"""The shm transport's shared-memory segments, as a launcher sees them: torch-free, for
the process that runs the launchers and the router.

A segment's path is announced in a handshake and opened, mapped or unlinked by another
process: only a name of pdserve's own shape, directly under SHM_DIR, is ever taken
(segment_name_problem), so that no announced path reaches another file.
"""

from __future__ import annotations

import os
import re

import msgpack

SHM_DIR = "/dev/shm"
PREFIX = "pdserve-kv-"  # engine/distributed/shm_files.py names a TP worker's rank caches so too
# The shm transport's pdserve-kv-<hex>, a TP worker's pdserve-kv-tp<pid>-<hex>-rank<r>: no
# dot and no slash, so no '..' and no subdirectory.
_NAME = re.compile(rf"{PREFIX}[A-Za-z0-9_-]+")


def segment_name_problem(path: object) -> str | None:
    """Why `path` is not a pdserve KV segment's path, or None if it is one (by its name
    alone: the file is checked once opened)."""
    if not isinstance(path, str):
        return f"{path!r} is not a path"
    directory, name = os.path.split(path)
    if directory != SHM_DIR or not _NAME.fullmatch(name):
        return f"{path!r} is not a file directly under {SHM_DIR} named {PREFIX}<letters, digits, '-' or '_'>"
    return None


def unlink_segment(metadata: bytes) -> None:
    """Remove the segments an shm agent announced in `metadata` (one per TP rank), if they
    still exist: a killed process cannot unlink its own (its owner calls this after it
    is gone). Only files named as pdserve's KV segments are removed."""
    meta = msgpack.unpackb(metadata, raw=False)
    paths = meta.get("data", {}).get("paths", []) if meta.get("transport") == "shm" else []
    for path in paths:
        if segment_name_problem(path) is None and os.path.exists(path):
            os.unlink(path)
