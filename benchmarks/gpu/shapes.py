"""The GPU check's two sets of shapes: the H200 run and the CPU smoke run."""

from __future__ import annotations

from dataclasses import dataclass

HBM_BYTES_PER_S = 4.23e12  # H200


@dataclass
class Setup:
    device: str
    dtype: str  # for rows 1-4
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    bw_batch: int
    bw_context: int
    step_batches: tuple[int, ...]
    step_context: int
    requests: int
    prompt_len: int
    new_tokens: int
    hf_batch: int


H200 = Setup("cuda", "bfloat16", 2048, 8192, 16, 32, 8, 128256, 64, 2048, (64, 256), 1024,
             1024, 512, 128, 128)
SMOKE = Setup("cpu", "float32", 64, 128, 2, 4, 2, 512, 2, 64, (2,), 40, 4, 24, 4, 4)
