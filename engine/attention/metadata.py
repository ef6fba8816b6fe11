"""One step's attention metadata, set around the forward pass by a context manager."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class AttentionMetadata:
    """Describes a flattened batch of `num_seqs` sequences, `num_tokens` new tokens.

    slot_mapping:    [num_tokens] int64, cache slot (block_id * block_size + offset) of
                     each new token's K/V; -1 = padding, not stored
    query_start_loc: [num_seqs + 1] int32, cumulative new-token counts (cu_seqlens_q)
    seq_lens:        [num_seqs] int32, context length after this step (cached + new)
    block_tables:    [num_seqs, max_blocks] int32, block ids per sequence; rows padded with 0
    The *_cpu lists mirror query lens / seq lens on the host so the torch reference
    can loop without device syncs.
    """

    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]
    # Speculative decoding: per sequence, how many of its new tokens are drafts (its last
    # token and its drafts are then attended as decode rows); None: no drafts this step.
    num_drafts_cpu: list[int] | None = None
    backend_state: Any = None  # whatever the attention backend's prepare() built for this step

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def is_pure_decode(self) -> bool:
        return all(q == 1 for q in self.query_lens_cpu)


_current: AttentionMetadata | None = None


@contextmanager
def attention_context(metadata: AttentionMetadata) -> Iterator[AttentionMetadata]:
    """Make `metadata` visible to attention layers for one forward pass (never nested)."""
    global _current
    assert _current is None, "attention contexts must not nest"
    _current = metadata
    try:
        yield metadata
    finally:
        _current = None


def current_metadata() -> AttentionMetadata:
    assert _current is not None, "attention called outside attention_context()"
    return _current
