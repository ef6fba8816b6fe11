"""Size the KV pool on a GPU from what a profiling forward pass leaves free."""

from __future__ import annotations

import logging

import numpy as np
import torch

from engine.attention.backend import AttentionBackend
from engine.model.config import ModelConfig
from engine.model.llama import LlamaForCausalLM
from engine.runner import ModelRunner, StepInputs, allocate_kv_cache
from engine.sampling import Sampler

logger = logging.getLogger(__name__)


def profile_num_kv_blocks(model: LlamaForCausalLM, cfg: ModelConfig, backend: AttentionBackend,
                          device: str, dtype: torch.dtype, block_size: int, max_tokens: int,
                          max_logits: int, gpu_memory_utilization: float) -> int:
    """KV blocks that fit in gpu_memory_utilization of the device's memory, after the
    weights, other processes, and the activation peak of the largest step: one
    sequence of max_tokens new tokens, sampling max_logits rows."""
    dev = torch.device(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(dev)
    baseline = torch.cuda.memory_allocated(dev)
    num_blocks = -(-max_tokens // block_size)
    scratch = allocate_kv_cache(cfg, num_blocks, block_size, dtype, device)
    runner = ModelRunner(model, scratch, block_size, Sampler(cfg.eos_token_ids), backend, device)
    rows = min(max_logits, max_tokens)
    runner.forward(StepInputs(
        input_ids=np.zeros(max_tokens, dtype=np.int64), positions=np.arange(max_tokens),
        slot_mapping=np.arange(max_tokens), query_start_loc=np.array([0, max_tokens], dtype=np.int32),
        seq_lens=np.array([max_tokens], dtype=np.int32),
        block_tables=np.arange(num_blocks, dtype=np.int32)[None, :],
        logits_indices=np.arange(max_tokens - rows, max_tokens), query_lens=[max_tokens]))
    torch.cuda.synchronize(dev)
    activations = torch.cuda.max_memory_allocated(dev) - baseline - scratch.numel() * scratch.element_size()
    del runner, scratch
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(dev)
    budget = total * gpu_memory_utilization - (total - free) - activations
    block_bytes = cfg.kv_bytes_per_token(dtype.itemsize) * block_size
    if budget < block_bytes:
        raise ValueError(
            f"gpu_memory_utilization={gpu_memory_utilization} of {total / 2**30:.1f} GiB leaves no "
            f"room for the KV cache: {(total - free) / 2**30:.2f} GiB in use (weights, other "
            f"processes), {activations / 2**30:.2f} GiB activation peak")
    logger.info("KV cache: %.2f GiB free for blocks after a %d-token profiling step "
                "(activation peak %.2f GiB)", budget / 2**30, max_tokens, activations / 2**30)
    return int(budget // block_bytes)
