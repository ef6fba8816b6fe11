"""Grammar masks applied to logits on the GPU: -inf wherever a row's bitmask has a 0 bit.

One program per (masked row, block of 32 * WORDS tokens): it reads its words of the
row's bitmask once and writes -inf over the forbidden tokens. Rows come from an index
list so only constrained rows of the batch are touched.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

WORDS = 32  # bitmask words (32 tokens each) per program


@triton.jit
def _apply_bitmask_kernel(logits_ptr, bitmask_ptr, rows_ptr, vocab, stride_l, stride_b,
                          WORDS: tl.constexpr):
    row = tl.load(rows_ptr + tl.program_id(0)).to(tl.int64)
    word0 = tl.program_id(1) * WORDS
    tokens = word0 * 32 + tl.arange(0, WORDS * 32)
    words = tl.load(bitmask_ptr + row * stride_b + word0 + tl.arange(0, WORDS * 32) // 32,
                    mask=tokens < vocab, other=0)
    allowed = ((words >> (tokens % 32)) & 1) != 0
    tl.store(logits_ptr + row * stride_l + tokens, float("-inf"), mask=(tokens < vocab) & ~allowed)


def apply_bitmask_triton(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """In place: logits [B, V] float32 (contiguous rows); bitmask [B, ceil(V/32)] int32
    on the same device, bit t of word t // 32 set where token t is allowed; rows: [R]
    int32/int64 indices of the rows to mask."""
    if logits.dim() != 2 or logits.stride(1) != 1 or logits.dtype != torch.float32:
        raise ValueError(f"need float32 logits [B, V] with contiguous rows, got {tuple(logits.shape)} "
                         f"{logits.dtype} (strides {logits.stride()})")
    vocab = logits.shape[1]
    if bitmask.dim() != 2 or bitmask.shape[1] * 32 < vocab or bitmask.dtype != torch.int32:
        raise ValueError(f"bitmask must be int32 [B, >= {triton.cdiv(vocab, 32)}], got "
                         f"{tuple(bitmask.shape)} {bitmask.dtype}")
    if len(rows):
        grid = (len(rows), triton.cdiv(triton.cdiv(vocab, 32), WORDS))
        _apply_bitmask_kernel[grid](logits, bitmask, rows, vocab, logits.stride(0), bitmask.stride(0),
                                    WORDS=WORDS, num_warps=4)
