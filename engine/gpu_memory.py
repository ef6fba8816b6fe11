"""Size the KV pool on a GPU from what a profiling forward pass leaves free.

gpu_memory_utilization is this engine's own share of the device (vLLM v1's meaning):
its weights, activation peak and KV pool together stay within that fraction, whatever
other processes hold. So two workers sharing one GPU (a prefill and a decode worker,
each sized by its own fraction) get the same pools whichever starts first; their
fractions must sum below 1, leaving room for each process's CUDA context, which is not
counted. A share that is not free now is an error naming the other processes' use,
never a smaller pool than asked for."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence

import numpy as np
import torch

from engine.attention.backend import AttentionBackend
from engine.model.config import ModelConfig
from engine.model.llama import LlamaForCausalLM
from engine.request import Request
from engine.runner import ModelRunner, StepInputs, allocate_kv_cache, build_step_inputs
from engine.sampling_params import SamplingParams
from engine.scheduler_output import ScheduledRequest

logger = logging.getLogger(__name__)


def profiling_inputs(max_tokens: int, max_seq_len: int, block_size: int, max_logits: int) -> StepInputs:
    """The largest step the scheduler can build: max_tokens new tokens, as prompts of at
    most max_seq_len tokens (a step's token budget may exceed the context length, with
    chunked prefill spreading it over several prompts), sampling max_logits rows. Each
    prompt has its own blocks, numbered from 0; flattened as the runner flattens a step."""
    lens = [max_seq_len] * (max_tokens // max_seq_len) + ([max_tokens % max_seq_len] if max_tokens % max_seq_len else [])
    scheduled = [ScheduledRequest(Request(f"profile-{i}", [0] * n, SamplingParams(max_tokens=1)), 0, n, True)
                 for i, n in enumerate(lens)]
    num_blocks = [-(-n // block_size) for n in lens]
    tables = np.zeros((len(lens), max(num_blocks)), dtype=np.int32)
    for row, (first, n) in enumerate(zip(np.cumsum([0] + num_blocks[:-1]), num_blocks)):
        tables[row, :n] = np.arange(first, first + n)
    rows = min(max_logits, max_tokens)
    return dataclasses.replace(build_step_inputs(scheduled, tables, block_size),
                               logits_indices=np.arange(max_tokens - rows, max_tokens))


def profile_num_kv_blocks(model: LlamaForCausalLM, cfg: ModelConfig, backend: AttentionBackend,
                          device: str, dtype: torch.dtype, block_size: int, max_tokens: int,
                          max_seq_len: int, max_logits: int, gpu_memory_utilization: float,
                          others: Sequence[tuple[LlamaForCausalLM, ModelConfig, AttentionBackend]] = ()) -> int:
    """KV blocks that fit in gpu_memory_utilization of the device's memory, after this
    engine's weights and the activation peak of the largest step: max_tokens new tokens
    in prompts of at most max_seq_len, sampling max_logits rows.

    `others`: models loaded (so counted among the weights) that run in the same steps,
    one forward after another, each with its own KV cache over the same block ids (a
    speculative draft model): the peak is the largest of their forwards' over the same
    step, and a block costs each model's KV bytes."""
    dev = torch.device(device)
    torch.cuda.empty_cache()
    baseline = torch.cuda.memory_allocated(dev)
    inputs = profiling_inputs(max_tokens, max_seq_len, block_size, max_logits)
    activations = max(_activation_peak(m, c, b, inputs, device, dtype, block_size)
                      for m, c, b in [(model, cfg, backend), *others])
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(dev)
    share = total * gpu_memory_utilization
    budget = share - baseline - activations  # the weights and activations are this engine's
    block_bytes = sum(c.kv_bytes_per_token(dtype.itemsize) for c in [cfg, *(c for _, c, _ in others)]) * block_size
    if budget < block_bytes:
        raise ValueError(
            f"gpu_memory_utilization={gpu_memory_utilization} ({share / 2**30:.2f} GiB of "
            f"{total / 2**30:.1f} GiB) leaves no room for the KV cache after this engine's "
            f"{baseline / 2**30:.2f} GiB of weights and {activations / 2**30:.2f} GiB activation peak")
    if budget > free - activations:
        raise ValueError(
            f"gpu_memory_utilization={gpu_memory_utilization} asks for a {budget / 2**30:.2f} GiB KV cache, "
            f"but only {free / 2**30:.2f} GiB of {total / 2**30:.1f} GiB is free ({(total - free) / 2**30:.2f} "
            f"GiB in use, by this engine's weights and other processes): lower it, or free the device")
    logger.info("KV cache: %.2f GiB free for blocks after a %d-token profiling step "
                "(activation peak %.2f GiB)", budget / 2**30, max_tokens, activations / 2**30)
    return int(budget // block_bytes)


def _activation_peak(model: LlamaForCausalLM, cfg: ModelConfig, backend: AttentionBackend, inputs: StepInputs,
                     device: str, dtype: torch.dtype, block_size: int) -> int:
    """Bytes a forward over `inputs` allocates above what is allocated before it,
    besides its scratch KV cache; freed again when it returns."""
    dev = torch.device(device)
    torch.cuda.reset_peak_memory_stats(dev)
    before = torch.cuda.memory_allocated(dev)
    scratch = allocate_kv_cache(cfg, int(inputs.block_tables.max()) + 1, block_size, dtype, device)
    runner = ModelRunner(model, scratch, block_size, None, backend, device)
    runner.forward(inputs)
    torch.cuda.synchronize(dev)
    peak = torch.cuda.max_memory_allocated(dev) - before - scratch.numel() * scratch.element_size()
    del runner, scratch
    return peak
