"""One step's inputs as one fixed-size int32 tensor: what the driver broadcasts to the
other ranks, once per step.

The size is fixed by the engine's limits (tokens per step, sequences, blocks per
sequence) because a broadcast needs the receivers' buffer ready before it arrives.
Only the block-table columns the step reads travel (up to its longest context).
"""

from __future__ import annotations

import numpy as np
import torch

from engine.errors import EngineStateError
from engine.runner import StepInputs

HEADER = 7  # tokens, sequences, block-table columns, logits rows, block copies, drafts travel, LoRA slots travel


class StepCodec:
    def __init__(self, max_tokens: int, max_seqs: int, block_size: int, max_model_len: int) -> None:
        self.max_tokens, self.max_seqs, self.block_size = max_tokens, max_seqs, block_size
        self.max_blocks = -(-max_model_len // block_size)
        # Logits rows: a sampled row per sequence, and prompt-logprob rows; at most one per
        # token. Block copies: at most one per sequence (a forked sequence's first write).
        # Drafts per sequence (speculative decoding), LoRA slots per sequence: only in
        # steps that have some.
        self.size = (HEADER + 3 * max_tokens + 2 * max_seqs + 1 + max_seqs * self.max_blocks + max_tokens
                     + 2 * max_seqs + max_seqs + max_seqs)

    def buffer(self) -> torch.Tensor:
        return torch.zeros(self.size, dtype=torch.int32)

    def encode(self, inputs: StepInputs, out: torch.Tensor) -> torch.Tensor:
        """Pack `inputs` (no placeholder tokens left) into `out`, a buffer()."""
        if len(inputs.placeholder_index):
            raise EngineStateError("a step with placeholder tokens cannot be broadcast")
        t, s = len(inputs.input_ids), len(inputs.seq_lens)
        cols = -(-int(inputs.seq_lens.max()) // self.block_size) if s else 0
        r, c = len(inputs.logits_indices), len(inputs.block_copies)
        if t > self.max_tokens or s > self.max_seqs or cols > self.max_blocks or r > self.max_tokens or c > self.max_seqs:
            raise EngineStateError(f"step of {t} tokens, {s} sequences, {cols} blocks each is "
                                   f"beyond the broadcast buffer's limits")
        d, lora = len(inputs.num_drafts) > 0, len(inputs.lora_slots) > 0
        parts = [np.array([t, s, cols, r, c, d, lora]), inputs.input_ids, inputs.positions, inputs.slot_mapping,
                 inputs.query_start_loc, inputs.seq_lens, inputs.block_tables[:, :cols].reshape(-1),
                 inputs.logits_indices, inputs.block_copies.reshape(-1), inputs.num_drafts, inputs.lora_slots]
        flat = np.concatenate([np.asarray(p, dtype=np.int32) for p in parts])
        out[:len(flat)] = torch.from_numpy(flat)
        return out

    def decode(self, buf: torch.Tensor) -> StepInputs:
        data = buf.numpy()
        t, s, cols, r, c, d, lora = (int(v) for v in data[:HEADER])
        at = HEADER

        def take(n: int, dtype=np.int64) -> np.ndarray:
            nonlocal at
            at += n
            return data[at - n:at].astype(dtype)

        input_ids, positions, slots = take(t), take(t), take(t)
        query_start_loc, seq_lens = take(s + 1, np.int32), take(s, np.int32)
        block_tables = take(s * cols, np.int32).reshape(s, cols)
        logits_indices = take(r)
        block_copies = take(2 * c).reshape(c, 2)
        num_drafts = take(s * d, np.int32)
        lora_slots = take(s * lora)
        return StepInputs(input_ids=input_ids, positions=positions, slot_mapping=slots,
                          query_start_loc=query_start_loc, seq_lens=seq_lens, block_tables=block_tables,
                          logits_indices=logits_indices, query_lens=np.diff(query_start_loc).tolist(),
                          block_copies=block_copies, num_drafts=num_drafts, lora_slots=lora_slots)
