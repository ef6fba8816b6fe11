"""The KV pool's profiling step (engine/gpu_memory.py), run on CPU with torch.cuda's
memory counters faked: it must be the largest step the scheduler can build, even when
the token budget exceeds the context length."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from engine import LLM
from engine.gpu_memory import profile_num_kv_blocks, profiling_inputs


def test_profiling_inputs_spread_a_budget_past_the_context_over_prompts() -> None:
    inputs = profiling_inputs(max_tokens=300, max_seq_len=128, block_size=16, max_logits=64)
    assert inputs.query_lens == [128, 128, 44] and inputs.seq_lens.tolist() == [128, 128, 44]
    assert inputs.query_start_loc.tolist() == [0, 128, 256, 300]
    assert inputs.positions.max() == 127 and len(inputs.input_ids) == 300
    # Every token has its own slot, in its own prompt's blocks.
    assert len(np.unique(inputs.slot_mapping)) == 300
    assert inputs.block_tables[2, :3].tolist() == [16, 17, 18]
    assert inputs.logits_indices.tolist() == list(range(236, 300))


def fake_cuda_memory(monkeypatch: pytest.MonkeyPatch, in_use: int, peak: int, free: int, total: int) -> None:
    """torch.cuda's memory counters as a GPU would report them (bytes); the rest no-ops."""
    for name in ("empty_cache", "reset_peak_memory_stats", "synchronize"):
        monkeypatch.setattr(torch.cuda, name, lambda *args: None)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda *args: in_use)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *args: peak)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *args: (free, total))


def test_profile_runs_a_step_larger_than_the_context(llama_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    llm = LLM(str(llama_dir), max_model_len=128)
    core = llm.core
    gib = 2**30
    # The 2 GiB in use are this engine's weights; the step's peak is 1 GiB above them.
    fake_cuda_memory(monkeypatch, 2 * gib, 3 * gib, 8 * gib, 10 * gib)
    blocks = profile_num_kv_blocks(core.model, core.model_config, core.runner.attention_backend, "cpu",
                                   torch.float32, 16, 300, core.max_model_len, 64, 0.9)
    block_bytes = core.model_config.kv_bytes_per_token(4) * 16
    scratch = 19 * block_bytes  # 8 + 8 + 3 blocks
    assert blocks == int((9 * gib - 2 * gib - (gib - scratch)) // block_bytes)


def test_two_engines_sharing_a_gpu_get_their_own_share_whichever_starts_first(
        llama_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A prefill and a decode worker on one GPU, each sized by its own fraction: the one
    that profiles second sees the first's whole share in use, and still gets its own."""
    llm = LLM(str(llama_dir), max_model_len=128)
    core = llm.core
    gib = 2**30
    total, weights, peak = 100 * gib, 2 * gib, 3 * gib
    for name in ("empty_cache", "reset_peak_memory_stats", "synchronize"):
        monkeypatch.setattr(torch.cuda, name, lambda *args: None)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda *args: weights)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *args: peak)
    block_bytes = core.model_config.kv_bytes_per_token(4) * 16

    def blocks(free: float, share: float) -> int:
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *args: (int(free), total))
        return profile_num_kv_blocks(core.model, core.model_config, core.runner.attention_backend, "cpu",
                                     torch.float32, 16, 64, core.max_model_len, 64, share)

    first = blocks(total - weights, 0.5)  # only its own weights in use yet
    second = blocks(total - 0.5 * total - weights, 0.4)  # the first's whole share, and its own weights
    scratch = 4 * block_bytes  # the profiling step's 64 tokens
    assert first == int((0.5 * total - weights - (peak - weights - scratch)) // block_bytes)
    assert second == int((0.4 * total - weights - (peak - weights - scratch)) // block_bytes)
    assert blocks(total - 0.4 * total - weights, 0.5) == first  # the other order: the same pools
    # A share that is not free is refused, naming what holds the device.
    with pytest.raises(ValueError, match=r"gpu_memory_utilization=0.6 asks for a .* GiB KV cache, but only "
                                         r"47.00 GiB of 100.0 GiB is free"):
        blocks(total - 0.5 * total - 3 * gib, 0.6)
