"""A batch's grammar masks: filled on the host from each constrained row's matcher,
applied to the logits on their device before any other sampling step."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import xgrammar as xgr

from engine.structured.matcher import GrammarState


class BitmaskBuffer:
    """A host bitmask reused across steps ([rows, ceil(vocab / 32)] int32, pinned when
    the logits are on a GPU), grown as batches grow."""

    def __init__(self) -> None:
        self._host: torch.Tensor | None = None

    def apply(self, logits: torch.Tensor, states: Sequence[GrammarState], rows: Sequence[int]) -> None:
        """In place: each row rows[i] of logits [B, V] float32 keeps only the tokens
        states[i]'s grammar allows next (the others become -inf)."""
        if not rows:
            return
        batch, vocab = logits.shape
        words = (vocab + 31) // 32
        host = self._host
        cuda = logits.device.type == "cuda"
        if host is None or host.shape[0] < batch or host.shape[1] != words:
            host = torch.empty((max(batch, 8), words), dtype=torch.int32, pin_memory=cuda)
            self._host = host
        mask = host[:batch]
        for state, row in zip(states, rows):
            state.fill(mask, row)
        if not cuda:
            xgr.apply_token_bitmask_inplace(logits, mask, vocab_size=vocab, indices=list(rows))
            return
        from engine.kernels.bitmask import apply_bitmask_triton

        device_rows = torch.tensor(list(rows), dtype=torch.int32).pin_memory().to(logits.device, non_blocking=True)
        apply_bitmask_triton(logits, mask.to(logits.device, non_blocking=True), device_rows)
