"""Paged decode attention: one query token per sequence over its block table.

Grid (sequence, KV head, program). A program loads the query heads that share its KV
head (GQA) as one [GROUPS_PAD, D] tile, so each K/V tile it reads serves all of
them, and walks its split's share of the context (or, at large batches, several
splits' shares in turn) in tiles of TILE tokens gathered through the block table (any
block size). The loop is software-pipelined
(num_stages): the next tiles' loads are in flight while one is being reduced, which
is what keeps HBM busy.

A sliding-window layer reads only the tiles from the one holding its window's first
position (seq_len - window); a split wholly before it reads nothing and writes an
empty partial (max -inf, sum 0), which the reduction weighs 0.

Split-KV: split j covers tokens [j * split_tokens, (j + 1) * split_tokens) (the last
split also takes any remainder), each writes an unnormalised partial (acc, max, sum)
and _reduce_kernel merges them, so long contexts with few sequences still fill the
GPU. Split boundaries are fixed in tokens, not derived from the split count, so the
result depends only on the context: an extra, empty split writes nothing and the
reduction skips it (it would have added exact zeros), and a single split (written
directly, no reduction) equals the reduction over one. Eager steps and CUDA graphs
(sized for longer contexts) therefore agree bit for bit.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from engine.kernels.common import (
    LaunchConfig,
    check_attention_io,
    check_index,
    check_softcap,
    dot_precision,
    kernel_window,
    native_dots,
    next_power_of_2,
)
from engine.kernels.online_softmax import load_kv_tile, online_softmax_step

SPLIT_TOKENS = 512  # context tokens per split
# Past about this many programs per SM (rounded up to whole splits per sequence and KV
# head), programs loop over several splits (split_programs_for). 16 keeps one program
# per split in every case gpu_check's bandwidth rows time (batch 64 at 2k: 2048
# programs on 132 SMs), and takes a batch-256 graph from 32768 programs to 4096.
PROGRAMS_PER_SM = 16

# The GPU tiles are the winner of the tile sweep (benchmarks/gpu_check.py --only tune) on
# an H200; its figures are in docs/benchmarks/2026-11-30-gpu-check-h200.md. The interpreter on CPU runs
# small tiles (the unit tests cover both).
GPU_CONFIG = LaunchConfig(block_n=64, num_warps=2, num_stages=3)
CPU_CONFIG = LaunchConfig(block_n=32, num_warps=4, num_stages=1)


def default_config(device: torch.device) -> LaunchConfig:
    return GPU_CONFIG if device.type == "cuda" else CPU_CONFIG


@triton.jit
def _attend(q, cache_ptr, table, seq_len, window, kv_head, d, first, last, scale, softcap,
            stride_c_block, stride_c_kv, stride_c_slot, stride_c_head,
            GROUPS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
            TILE: tl.constexpr, PRECISION: tl.constexpr, NATIVE: tl.constexpr, SOFTCAP: tl.constexpr):
    """Unnormalised (max, sum, acc) of q over the context tiles [first, last), those
    before the window's (whose first position is seq_len - window) skipped."""
    m = tl.full([GROUPS_PAD], float("-inf"), tl.float32)
    l = tl.zeros([GROUPS_PAD], tl.float32)
    acc = tl.zeros([GROUPS_PAD, HEAD_DIM], tl.float32)
    t = tl.arange(0, TILE)
    lo = tl.maximum(seq_len - window, 0)
    for tile in range(tl.maximum(first, lo // TILE), last):
        pos = tile * TILE + t
        valid = (pos < seq_len) & (pos >= lo)
        k, v = load_kv_tile(cache_ptr, table, pos, valid, kv_head, d, stride_c_block, stride_c_kv,
                            stride_c_slot, stride_c_head, BLOCK_SIZE, NATIVE)
        # Every tile read holds a valid position, so each row's max is finite from the first.
        m, l, acc = online_softmax_step(q, k, v, valid[None, :], m, l, acc, scale, softcap, PRECISION, SOFTCAP)
    return m, l, acc


@triton.jit
def _split_partial(q, cache_ptr, table, seq_len, window, kv_head, g, d, split, num_splits, num_tiles,
                   part, part_acc_ptr, part_max_ptr, part_sum_ptr, scale, softcap,
                   stride_c_block, stride_c_kv, stride_c_slot, stride_c_head,
                   GROUPS: tl.constexpr, GROUPS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
                   BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr, TILES_PER_SPLIT: tl.constexpr,
                   PRECISION: tl.constexpr, NATIVE: tl.constexpr, SOFTCAP: tl.constexpr, store):
    """Split `split`'s partial (max, sum, acc) into slot part + split, if `store`."""
    first = split * TILES_PER_SPLIT
    last = num_tiles
    if split < num_splits - 1:
        last = tl.minimum(first + TILES_PER_SPLIT, num_tiles)
    m, l, acc = _attend(q, cache_ptr, table, seq_len, window, kv_head, d, first, last, scale, softcap,
                        stride_c_block, stride_c_kv, stride_c_slot, stride_c_head,
                        GROUPS_PAD, HEAD_DIM, BLOCK_SIZE, TILE, PRECISION, NATIVE, SOFTCAP)
    gmask = (g < GROUPS) & store
    tl.store(part_max_ptr + part + split, m, mask=gmask)
    tl.store(part_sum_ptr + part + split, l, mask=gmask)
    tl.store(part_acc_ptr + (part + split)[:, None] * HEAD_DIM + d[None, :], acc, mask=gmask[:, None])


@triton.jit
def _decode_kernel(out_ptr, part_acc_ptr, part_max_ptr, part_sum_ptr,
                   q_ptr, cache_ptr, block_tables_ptr, seq_lens_ptr, rows_ptr,
                   stride_q_tok, stride_q_head, stride_o_tok, stride_o_head,
                   stride_c_block, stride_c_kv, stride_c_slot, stride_c_head, stride_bt,
                   scale, num_splits, window, softcap,
                   GROUPS: tl.constexpr, GROUPS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
                   BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr, TILES_PER_SPLIT: tl.constexpr,
                   SPLIT: tl.constexpr, LOOP_SPLITS: tl.constexpr, PRECISION: tl.constexpr,
                   NATIVE: tl.constexpr, SOFTCAP: tl.constexpr):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + seq)
    token = tl.load(rows_ptr + seq).to(tl.int64)
    num_tiles = tl.cdiv(seq_len, TILE)
    # Splits this context reaches (the last split takes any remainder). A CUDA graph
    # launches those of the longest context it serves; the rest read and write nothing.
    used = tl.minimum(num_splits, tl.cdiv(num_tiles, TILES_PER_SPLIT))
    g = tl.arange(0, GROUPS_PAD)
    d = tl.arange(0, HEAD_DIM)
    heads = kv_head * GROUPS + g
    q = tl.load(q_ptr + token * stride_q_tok + heads[:, None] * stride_q_head + d[None, :],
                mask=(g[:, None] < GROUPS) & (tl.program_id(2) < used), other=0.0)
    if not NATIVE:
        q = q.to(tl.float32)
    table = block_tables_ptr + seq * stride_bt

    if SPLIT:
        # Partials are [seqs, q_heads, splits(, D)], one per split whichever program
        # computes it; the reduction reads only the `used` ones.
        part = (seq * (tl.num_programs(1) * GROUPS) + heads) * num_splits
        if LOOP_SPLITS:  # fewer programs than splits: each takes every num_programs(2)-th
            for split in range(tl.program_id(2), used, tl.num_programs(2)):
                _split_partial(q, cache_ptr, table, seq_len, window, kv_head, g, d, split, num_splits, num_tiles,
                               part, part_acc_ptr, part_max_ptr, part_sum_ptr, scale, softcap,
                               stride_c_block, stride_c_kv, stride_c_slot, stride_c_head, GROUPS, GROUPS_PAD,
                               HEAD_DIM, BLOCK_SIZE, TILE, TILES_PER_SPLIT, PRECISION, NATIVE, SOFTCAP, True)
        else:  # one split per program; those past the context store nothing
            split = tl.program_id(2)
            _split_partial(q, cache_ptr, table, seq_len, window, kv_head, g, d, split, num_splits, num_tiles,
                           part, part_acc_ptr, part_max_ptr, part_sum_ptr, scale, softcap,
                           stride_c_block, stride_c_kv, stride_c_slot, stride_c_head, GROUPS, GROUPS_PAD,
                           HEAD_DIM, BLOCK_SIZE, TILE, TILES_PER_SPLIT, PRECISION, NATIVE, SOFTCAP, split < used)
    else:
        m, l, acc = _attend(q, cache_ptr, table, seq_len, window, kv_head, d, 0, num_tiles, scale, softcap,
                            stride_c_block, stride_c_kv, stride_c_slot, stride_c_head,
                            GROUPS_PAD, HEAD_DIM, BLOCK_SIZE, TILE, PRECISION, NATIVE, SOFTCAP)
        out = acc / l[:, None]
        tl.store(out_ptr + token * stride_o_tok + heads[:, None] * stride_o_head + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=g[:, None] < GROUPS)


@triton.jit
def _reduce_kernel(out_ptr, part_acc_ptr, part_max_ptr, part_sum_ptr, rows_ptr, seq_lens_ptr,
                   stride_o_tok, stride_o_head, num_q_heads, num_splits, split_tokens,
                   SPLITS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    token = tl.load(rows_ptr + seq).to(tl.int64)
    # The splits this context reaches; the rest wrote nothing. Masked lanes load the
    # values an empty split would have had (max -inf, sum 0), so results are unchanged.
    used = tl.minimum(num_splits, tl.cdiv(tl.load(seq_lens_ptr + seq), split_tokens))
    s = tl.arange(0, SPLITS_PAD)
    d = tl.arange(0, HEAD_DIM)
    part = (seq * num_q_heads + head) * num_splits + s
    smask = s < used
    m = tl.load(part_max_ptr + part, mask=smask, other=float("-inf"))
    l = tl.load(part_sum_ptr + part, mask=smask, other=0.0)
    acc = tl.load(part_acc_ptr + part[:, None] * HEAD_DIM + d[None, :], mask=smask[:, None], other=0.0)
    m_all = tl.max(m, 0)
    w = tl.where(smask & (l > 0), tl.exp(m - m_all), 0.0)
    out = tl.sum(acc * w[:, None], 0) / tl.sum(l * w, 0)
    tl.store(out_ptr + token * stride_o_tok + head * stride_o_head + d, out.to(out_ptr.dtype.element_ty))


def num_splits_for(max_seq_len: int, split_tokens: int = SPLIT_TOKENS) -> int:
    """Splits that give every context up to max_seq_len its fixed-size splits."""
    return max(1, -(-max_seq_len // split_tokens))


def split_programs_for(num_seqs: int, num_kv_heads: int, num_splits: int, device: torch.device) -> int:
    """Programs per (sequence, KV head): one per split while the grid stays within
    PROGRAMS_PER_SM programs per SM, fewer (each looping over several splits) past that.
    A CUDA graph captured for 256 sequences and 8k contexts would otherwise launch 16
    splits x 2048 programs, most of them for splits past a shorter context."""
    return min(num_splits, max(1, -(-PROGRAMS_PER_SM * _num_sms(device) // (num_seqs * num_kv_heads))))


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 132  # the interpreter: as on an H200
    return torch.cuda.get_device_properties(device).multi_processor_count


def decode_attention(out: torch.Tensor, query: torch.Tensor, layer_cache: torch.Tensor,
                     rows: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                     scale: float, num_splits: int = 1, split_tokens: int = SPLIT_TOKENS,
                     config: LaunchConfig | None = None, split_programs: int | None = None,
                     window: int = 0, softcap: float = 0.0) -> None:
    """out[rows[i]] = attention of query[rows[i]] over seq_lens[i] cached tokens in the
    blocks block_tables[i], for each decode sequence i.

    out, query:   [T, Hq, D] (the flattened batch; only `rows` are read and written)
    layer_cache:  [num_blocks, 2, block_size, H, D], this step's K/V already stored
    rows:         [B] int32 token indices; block_tables [B, max_blocks] int32; seq_lens [B] int32
    num_splits:   num_splits_for(longest context) keeps results independent of it; fewer
                  is still correct (the last split takes the rest) but rounds differently
    config:       tiles and launch options (default_config: tuned for the GPU)
    split_programs: programs per (sequence, KV head) sharing the splits (default
                  split_programs_for); results do not depend on it
    window:       > 0: a sliding window, each row attends over its last `window` tokens
    softcap:      > 0: scores soft-capped to softcap * tanh(score / softcap) (Gemma 2)
    """
    block_size, num_kv_heads, head_dim, num_q_heads = check_attention_io(out, query, layer_cache)
    device = layer_cache.device
    num_seqs = rows.shape[0]
    check_index("rows", rows, 1, torch.int32, device)
    check_index("block_tables", block_tables, 2, torch.int32, device, num_seqs)
    check_index("seq_lens", seq_lens, 1, torch.int32, device, num_seqs)
    config = config or default_config(layer_cache.device)
    tile = config.block_n
    if num_splits < 1 or split_tokens < tile or split_tokens % tile:
        raise ValueError(f"need num_splits >= 1 and split_tokens a multiple of the {tile}-token "
                         f"tile, got {num_splits} and {split_tokens}")
    if split_programs is not None and not 1 <= split_programs <= num_splits:
        raise ValueError(f"split_programs must be in [1, num_splits={num_splits}], got {split_programs}")
    if num_seqs == 0:
        return
    groups = num_q_heads // num_kv_heads
    cache_strides = layer_cache.stride()[:4]
    common = dict(GROUPS=groups, GROUPS_PAD=max(16, next_power_of_2(groups)), HEAD_DIM=head_dim,
                  BLOCK_SIZE=block_size, TILE=tile, TILES_PER_SPLIT=split_tokens // tile,
                  PRECISION=dot_precision(query.dtype), NATIVE=native_dots(layer_cache, query),
                  SOFTCAP=check_softcap(softcap) > 0, num_warps=config.num_warps, num_stages=config.num_stages)
    if num_splits == 1:
        _decode_kernel[(num_seqs, num_kv_heads, 1)](
            out, out, out, out, query, layer_cache, block_tables, seq_lens, rows, query.stride(0),
            query.stride(1), out.stride(0), out.stride(1), *cache_strides, block_tables.stride(0), scale, 1,
            kernel_window(window), softcap, SPLIT=False, LOOP_SPLITS=False, **common)
        return
    programs = split_programs_for(num_seqs, num_kv_heads, num_splits, device) if split_programs is None \
        else split_programs
    grid = (num_seqs, num_kv_heads, programs)
    part_acc = torch.empty((num_seqs, num_q_heads, num_splits, head_dim), dtype=torch.float32, device=device)
    part_max = torch.empty((num_seqs, num_q_heads, num_splits), dtype=torch.float32, device=device)
    part_sum = torch.empty_like(part_max)
    _decode_kernel[grid](out, part_acc, part_max, part_sum, query, layer_cache, block_tables, seq_lens,
                         rows, query.stride(0), query.stride(1), out.stride(0), out.stride(1),
                         *cache_strides, block_tables.stride(0), scale, num_splits, kernel_window(window), softcap,
                         SPLIT=True,
                         LOOP_SPLITS=programs < num_splits, **common)
    _reduce_kernel[(num_seqs, num_q_heads)](out, part_acc, part_max, part_sum, rows, seq_lens,
                                            out.stride(0), out.stride(1), num_q_heads, num_splits,
                                            split_tokens, SPLITS_PAD=next_power_of_2(num_splits),
                                            HEAD_DIM=head_dim)
