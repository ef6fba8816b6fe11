"""One-launch copy of KV blocks between two caches on the same GPU (cuda_ipc's data plane).

A write lists block pairs (src[i] -> dst[i]). Copying run by run costs a slice pair
and a launch record per run in Python, which for a write of hundreds of runs takes
longer than moving the bytes (docs/benchmarks/2026-11-30-gpu-check-h200.md, KV transfer). Here the
pairs go to the GPU as two index arrays and one kernel moves every block, one program
per (block, chunk), in 8-byte words where the block size allows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

CHUNK = 4096  # words per program


@triton.jit
def _copy_blocks_kernel(src_ptr, dst_ptr, src_ids_ptr, dst_ids_ptr, words_per_block, CHUNK: tl.constexpr):
    i = tl.program_id(0)
    offs = tl.program_id(1) * CHUNK + tl.arange(0, CHUNK)
    mask = offs < words_per_block
    src_block = tl.load(src_ids_ptr + i).to(tl.int64)
    dst_block = tl.load(dst_ids_ptr + i).to(tl.int64)
    words = tl.load(src_ptr + src_block * words_per_block + offs, mask=mask)
    tl.store(dst_ptr + dst_block * words_per_block + offs, words, mask=mask)


def as_words(blocks: torch.Tensor) -> torch.Tensor:
    """[blocks, bytes] uint8 as the widest integer words that divide a block."""
    if blocks.dim() != 2 or blocks.dtype != torch.uint8 or not blocks.is_contiguous():
        raise ValueError("expected a contiguous [blocks, bytes] uint8 view of a cache")
    for dtype in (torch.int64, torch.int32, torch.int16):
        if blocks.shape[1] % dtype.itemsize == 0:
            return blocks.view(dtype)
    return blocks


def copy_blocks(src: torch.Tensor, dst: torch.Tensor, src_ids: torch.Tensor, dst_ids: torch.Tensor) -> None:
    """dst[dst_ids[i]] = src[src_ids[i]] for every i, in one launch on the current stream.

    src, dst: [blocks, words] of one dtype and row size (as_words); ids: int32 or
    int64 on the same device, one per block, in range (not checked here: the
    transport validates block ids before a write starts).
    """
    if src.dtype != dst.dtype or src.shape[1] != dst.shape[1] or src.device != dst.device:
        raise ValueError(f"caches differ: {src.dtype} {tuple(src.shape)} on {src.device} vs "
                         f"{dst.dtype} {tuple(dst.shape)} on {dst.device}")
    if src_ids.shape != dst_ids.shape or src_ids.dim() != 1:
        raise ValueError(f"need two 1-D id arrays of one length, got {tuple(src_ids.shape)} and {tuple(dst_ids.shape)}")
    if src_ids.numel() == 0:
        return
    words = src.shape[1]
    grid = (src_ids.numel(), triton.cdiv(words, CHUNK))
    _copy_blocks_kernel[grid](src, dst, src_ids, dst_ids, words, CHUNK=CHUNK)
