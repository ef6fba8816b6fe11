"""The names of rank-cache files under /dev/shm, and removing those of drivers that are
gone. Torch-free: the launchers (in the router's process) sweep too."""

from __future__ import annotations

import os
import re
import uuid

SHM_DIR = "/dev/shm"
PREFIX = "pdserve-kv-"  # the shm transport's prefix too: launchers unlink what a dead worker left
# Rank caches carry their driver's pid. A driver killed while starting has told no
# launcher its files' names; they are found by that pid once it no longer runs.
_OWNED = re.compile(rf"^{PREFIX}tp(\d+)-")


def rank_cache_paths(size: int) -> list[str]:
    """New, unique paths for one driver's `size` rank caches."""
    tag = f"tp{os.getpid()}-{uuid.uuid4().hex}"
    return [os.path.join(SHM_DIR, f"{PREFIX}{tag}-rank{r}") for r in range(size)]


def sweep_orphans() -> list[str]:
    """Remove the rank caches of drivers that no longer run; returns their paths."""
    gone = []
    for name in os.listdir(SHM_DIR) if os.path.isdir(SHM_DIR) else []:
        match = _OWNED.match(name)
        if match and not _alive(int(match.group(1))):
            gone.append(os.path.join(SHM_DIR, name))
    unlink(gone)
    return gone


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        pass
    return True


def unlink(paths: list[str]) -> None:
    for path in paths:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
