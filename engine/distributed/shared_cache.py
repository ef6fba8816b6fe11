"""KV caches in files under /dev/shm: the driver creates one per rank and maps them all,
each follower maps its own. So on CPU the driver's KV transport reaches every rank's
cache (a transfer moves each rank's heads), while each rank computes on its own."""

from __future__ import annotations

import mmap
import os

import torch

from engine.distributed.shm_files import rank_cache_paths, sweep_orphans, unlink


def _map(path: str, nbytes: int, create: bool) -> torch.Tensor:
    fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | (os.O_CREAT | os.O_EXCL if create else 0), 0o600)
    try:
        if create:
            os.fchmod(fd, 0o600)  # only this user, whatever the umask (which may take the owner's bits too)
            os.ftruncate(fd, nbytes)
        elif os.fstat(fd).st_size != nbytes:
            raise ValueError(f"{path} holds {os.fstat(fd).st_size} bytes, expected {nbytes}")
        m = mmap.mmap(fd, nbytes)
    finally:
        os.close(fd)
    # The tensor keeps the mapping alive (frombuffer holds a reference to it).
    return torch.frombuffer(m, dtype=torch.uint8)


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return torch.Size(shape).numel() * dtype.itemsize


def create_rank_caches(shape: tuple[int, ...], dtype: torch.dtype, size: int) -> tuple[list[str], list[torch.Tensor]]:
    """One zeroed file-backed cache of `shape` per rank: (paths, tensors)."""
    sweep_orphans()
    paths = rank_cache_paths(size)
    caches = []
    try:
        for path in paths:
            caches.append(_map(path, _nbytes(shape, dtype), create=True).view(dtype).view(shape))
    except BaseException:
        unlink(paths)
        raise
    return paths, caches


def attach(path: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return _map(path, _nbytes(shape, dtype), create=False).view(dtype).view(shape)


__all__ = ["attach", "create_rank_caches", "unlink"]
