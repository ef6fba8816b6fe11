"""Model runner: owns the model and the KV cache tensor; turns a schedule into tokens."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from engine.attention.backend import AttentionBackend
from engine.attention.metadata import AttentionMetadata, attention_context
from engine.model.config import ModelConfig
from engine.model.llama import LlamaForCausalLM
from engine.sampling import Sampler, SamplerOutput, SamplingRow
from engine.scheduler import ScheduledRequest


def allocate_kv_cache(cfg: ModelConfig, num_blocks: int, block_size: int,
                      dtype: torch.dtype, device: str) -> torch.Tensor:
    """[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim], block-major.

    Block-major means one block of every layer is one contiguous region, so moving a
    run of consecutive blocks between workers is one descriptor.
    """
    shape = (num_blocks, cfg.num_layers, 2, block_size, cfg.num_kv_heads, cfg.head_dim)
    return torch.zeros(shape, dtype=dtype, device=device)


class ModelRunner:
    """Called by the engine core once per step with the scheduler's output."""

    def __init__(self, model: LlamaForCausalLM, kv_cache: torch.Tensor, block_size: int,
                 sampler: Sampler, attention_backend: AttentionBackend, device: str) -> None:
        self.model = model
        self.attention_backend = attention_backend
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.sampler = sampler
        self.device = torch.device(device)
        model.bind_kv_cache(kv_cache)

    def prepare(self, scheduled: Sequence[ScheduledRequest],
                block_ids: Sequence[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Flatten the step into (input_ids, positions, logits_indices, metadata)."""
        bs = self.block_size
        input_ids, positions, slots = [], [], []
        query_lens, seq_lens, logits_indices = [], [], []
        max_blocks = max(len(b) for b in block_ids)
        block_tables = np.zeros((len(scheduled), max_blocks), dtype=np.int32)
        offset = 0
        for i, (s, blocks) in enumerate(zip(scheduled, block_ids)):
            start, n = s.request.num_computed_tokens, s.num_new_tokens
            pos = np.arange(start, start + n)
            table = np.asarray(blocks, dtype=np.int64)
            block_tables[i, :len(blocks)] = table
            input_ids.append(np.asarray(s.request.all_token_ids[start:start + n], dtype=np.int64))
            positions.append(pos)
            slots.append(table[pos // bs] * bs + pos % bs)
            query_lens.append(n)
            seq_lens.append(start + n)
            offset += n
            if s.samples:
                logits_indices.append(offset - 1)

        def dev(a: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(a).to(self.device, non_blocking=True)

        md = AttentionMetadata(
            slot_mapping=dev(np.concatenate(slots)),
            query_start_loc=dev(np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int32)),
            seq_lens=dev(np.asarray(seq_lens, dtype=np.int32)),
            block_tables=dev(block_tables),
            query_lens_cpu=query_lens,
            seq_lens_cpu=seq_lens,
        )
        return (dev(np.concatenate(input_ids)), dev(np.concatenate(positions)),
                dev(np.asarray(logits_indices, dtype=np.int64)), md)

    @torch.inference_mode()
    def execute(self, scheduled: Sequence[ScheduledRequest],
                block_ids: Sequence[Sequence[int]]) -> SamplerOutput:
        """Run one forward over all scheduled tokens; sample one token for each request
        whose step reaches its last token (in `scheduled` order)."""
        input_ids, positions, logits_indices, md = self.prepare(scheduled, block_ids)
        self.attention_backend.prepare(md, self.block_size)
        with attention_context(md):
            logits = self.model(input_ids, positions, logits_indices)
        rows = [SamplingRow(s.request.sampling_params, s.request.prompt_token_ids,
                            s.request.output_token_ids, s.request.generator)
                for s in scheduled if s.samples]
        if not rows:
            return SamplerOutput([], [])
        return self.sampler(logits, rows)
