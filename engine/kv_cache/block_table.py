"""Every request's block ids as a row of one numpy array, so a step's block table is a gather.

Building a step's [num_seqs, max_blocks] table from each request's list of blocks costs
one list conversion per request every step, the largest single piece of a decode step's
host work at large batches (docs/benchmarks/2026-11-30-host-overhead.md). Block ids only ever get
appended to a request (until it frees them all), so the manager writes each id here
once, when the block is allocated, and a step's table is one fancy-index gather.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class BlockTable:
    """Rows are handed out per request and reused after it frees its blocks. Entries past
    a row's length are always 0, so gathered rows come out padded with 0. Size: the most
    requests ever holding blocks at once x the most blocks one ever held, 4 bytes each."""

    def __init__(self, rows: int = 64, cols: int = 64) -> None:
        self._ids = np.zeros((rows, cols), dtype=np.int32)
        self._lens = np.zeros(rows, dtype=np.int64)  # block ids written per row
        self._row_of: dict[str, int] = {}
        self._free_rows = list(range(rows - 1, -1, -1))  # pop() hands out the lowest first

    def append(self, request_id: str, block_ids: Sequence[int]) -> None:
        """The request's next blocks, in order."""
        row = self._row_of.get(request_id)
        if row is None:
            if not self._free_rows:
                self._grow(rows=2 * len(self._lens))
            row = self._row_of[request_id] = self._free_rows.pop()
        start = int(self._lens[row])
        end = start + len(block_ids)
        if end > self._ids.shape[1]:
            self._grow(cols=max(end, 2 * self._ids.shape[1]))
        self._ids[row, start:end] = block_ids
        self._lens[row] = end

    def set(self, request_id: str, index: int, block_id: int) -> None:
        """Replace the request's block at `index` (a shared block copied on write)."""
        row = self._row_of[request_id]
        if not 0 <= index < self._lens[row]:
            raise IndexError(f"request {request_id!r} has {int(self._lens[row])} blocks, no block {index}")
        self._ids[row, index] = block_id

    def remove(self, request_id: str) -> None:
        """The request freed all its blocks."""
        row = self._row_of.pop(request_id, None)
        if row is not None:
            self._ids[row, :self._lens[row]] = 0
            self._lens[row] = 0
            self._free_rows.append(row)

    def gather(self, request_ids: Sequence[str]) -> np.ndarray:
        """[len(request_ids), most blocks any of them holds] int32, a new array."""
        rows = np.fromiter((self._row_of[r] for r in request_ids), dtype=np.int64,
                           count=len(request_ids))
        return self._ids[rows, :int(self._lens[rows].max(initial=0))]

    def _grow(self, rows: int | None = None, cols: int | None = None) -> None:
        old_rows, old_cols = self._ids.shape
        rows, cols = rows or old_rows, cols or old_cols
        ids = np.zeros((rows, cols), dtype=np.int32)
        ids[:old_rows, :old_cols] = self._ids
        self._ids = ids
        if rows > old_rows:
            self._lens = np.concatenate([self._lens, np.zeros(rows - old_rows, dtype=np.int64)])
            self._free_rows = list(range(rows - 1, old_rows - 1, -1)) + self._free_rows
