"""Model runner: owns the model and the KV cache tensor; turns a schedule into tokens."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from engine.attention.backend import AttentionBackend
from engine.attention.metadata import AttentionMetadata, attention_context
from engine.model.config import ModelConfig
from engine.model.llama import LlamaForCausalLM
from engine.sampling import Sampler, SamplerOutput
from engine.scheduler import ScheduledRequest
from engine.staging import Uploader


KVAllocator = Callable[[tuple[int, ...], torch.dtype, str], torch.Tensor]


def allocate_kv_cache(cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                      device: str, allocator: KVAllocator | None = None) -> torch.Tensor:
    """[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim], block-major.

    Block-major means one block of every layer is one contiguous region, so moving a
    run of consecutive blocks between workers is one descriptor. `allocator` (shape,
    dtype, device) places it where a KV transport can reach it (e.g. shared memory).
    """
    shape = (num_blocks, cfg.num_layers, 2, block_size, cfg.num_kv_heads, cfg.head_dim)
    if allocator is None:
        return torch.zeros(shape, dtype=dtype, device=device)
    return allocator(shape, dtype, device)


@dataclass
class StepInputs:
    """One step's flattened batch on the host, before upload."""

    input_ids: np.ndarray  # [T] int64
    positions: np.ndarray  # [T] int64
    slot_mapping: np.ndarray  # [T] int64, cache slot of each token's K/V
    query_start_loc: np.ndarray  # [S + 1] int32
    seq_lens: np.ndarray  # [S] int32, context after this step
    block_tables: np.ndarray  # [S, max_blocks] int32
    logits_indices: np.ndarray  # [R] int64, tokens whose logits are sampled
    query_lens: list[int]

    @property
    def is_pure_decode(self) -> bool:
        return len(self.input_ids) == len(self.query_lens)


def build_step_inputs(scheduled: Sequence[ScheduledRequest], block_tables: np.ndarray,
                      block_size: int) -> StepInputs:
    """Flatten a step. block_tables: [S, max_blocks] int32, row i = scheduled[i]'s blocks.

    One Python pass reads each request's counters and new token ids; the per-token
    arrays are then numpy over the whole batch. Per-request numpy calls would cost more
    than everything else here together at decode batch sizes.
    """
    num_seqs = len(scheduled)
    starts, query_lens, samples, token_ids = [], [], [], []
    for s in scheduled:
        start, n = s.request.num_computed_tokens, s.num_new_tokens
        starts.append(start)
        query_lens.append(n)
        samples.append(s.samples)
        token_ids += s.request.all_token_ids[start:start + n]
    start_arr = np.array(starts, dtype=np.int64)
    len_arr = np.array(query_lens, dtype=np.int64)
    ends = np.cumsum(len_arr)  # exclusive end of each sequence's tokens in the batch
    if (len_arr == 1).all():  # pure decode
        seq_of_token, positions = np.arange(num_seqs), start_arr
    else:
        seq_of_token = np.repeat(np.arange(num_seqs), len_arr)
        # position = token index in the batch - its sequence's first index + its start
        positions = np.arange(len(token_ids)) + np.repeat(start_arr - (ends - len_arr), len_arr)
    blocks = block_tables[seq_of_token, positions // block_size].astype(np.int64)
    query_start_loc = np.zeros(num_seqs + 1, dtype=np.int32)
    query_start_loc[1:] = ends
    return StepInputs(
        input_ids=np.array(token_ids, dtype=np.int64), positions=positions,
        slot_mapping=blocks * block_size + positions % block_size,
        query_start_loc=query_start_loc, seq_lens=(start_arr + len_arr).astype(np.int32),
        block_tables=block_tables, logits_indices=(ends - 1)[np.array(samples, dtype=bool)],
        query_lens=query_lens)


class ModelRunner:
    """Called by the engine core once per step with the scheduler's output.

    On CUDA, pure-decode steps replay captured CUDA graphs when `graphs` is set
    (engine/cuda_graphs.py); every other step runs eagerly.
    """

    def __init__(self, model: LlamaForCausalLM, kv_cache: torch.Tensor, block_size: int,
                 sampler: Sampler, attention_backend: AttentionBackend, device: str) -> None:
        self.model = model
        self.attention_backend = attention_backend
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.sampler = sampler
        self.device = torch.device(device)
        self.uploader = Uploader(self.device)
        self.graphs = None  # CudaGraphRunner, set by the engine core after capture
        model.bind_kv_cache(kv_cache)

    @torch.inference_mode()
    def forward(self, inputs: StepInputs) -> torch.Tensor:
        """Logits [R, vocab] float32 for inputs.logits_indices, eagerly."""
        ids, pos, slots, qsl, seq_lens, tables, logits_idx = self.uploader.upload(
            inputs.input_ids, inputs.positions, inputs.slot_mapping, inputs.query_start_loc,
            inputs.seq_lens, inputs.block_tables, inputs.logits_indices)
        md = AttentionMetadata(slot_mapping=slots, query_start_loc=qsl, seq_lens=seq_lens,
                               block_tables=tables, query_lens_cpu=inputs.query_lens,
                               seq_lens_cpu=inputs.seq_lens.tolist())
        self.attention_backend.prepare(md, self.block_size)
        with attention_context(md):
            return self.model(ids, pos, logits_idx)

    @torch.inference_mode()
    def execute(self, scheduled: Sequence[ScheduledRequest], block_tables: np.ndarray) -> SamplerOutput:
        """Run one forward over all scheduled tokens; sample one token for each request
        whose step reaches its last token (in `scheduled` order). block_tables: [S,
        max_blocks] int32 (KVCacheManager.block_tables)."""
        inputs = build_step_inputs(scheduled, block_tables, self.block_size)
        if self.graphs is not None and self.graphs.can_run(inputs):
            logits = self.graphs.run(inputs)
        else:
            logits = self.forward(inputs)
        rows = [s.request.sampling_row for s in scheduled if s.samples]
        if not rows:
            return SamplerOutput([], [])
        return self.sampler(logits, rows)
