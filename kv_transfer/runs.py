"""Coalescing block lists into runs: one descriptor per run of consecutive blocks."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def coalesce(src: Sequence[int], dst: Sequence[int], max_count: int | None = None) -> list[tuple[int, int, int]]:
    """(src_start, dst_start, count) for maximal runs where both sides are consecutive,
    of at most max_count blocks each (None: no bound).

    src[i] is written to dst[i]; the order of the lists is kept.
    """
    if len(src) != len(dst):
        raise ValueError(f"{len(src)} source blocks but {len(dst)} destination blocks")
    if max_count is not None and max_count < 1:
        raise ValueError(f"max_count must be >= 1, got {max_count}")
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src, dst):
        if runs:
            s0, d0, n = runs[-1]
            if s == s0 + n and d == d0 + n and (max_count is None or n < max_count):
                runs[-1] = (s0, d0, n + 1)
                continue
        runs.append((s, d, 1))
    return runs


def block_pairs(runs: Sequence[tuple[int, int, int]]) -> tuple[np.ndarray, np.ndarray]:
    """The runs back as (source, destination) block ids, one pair per block, int32: for
    data planes that move a write in one call over per-block indices."""
    counts = np.fromiter((n for *_, n in runs), dtype=np.int64, count=len(runs))
    offsets = np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts)
    src = np.repeat(np.fromiter((s for s, _, _ in runs), dtype=np.int64, count=len(runs)), counts) + offsets
    dst = np.repeat(np.fromiter((d for _, d, _ in runs), dtype=np.int64, count=len(runs)), counts) + offsets
    return src.astype(np.int32), dst.astype(np.int32)
