"""Multi-head latent attention (DeepSeek-V2/V3) decode, absorbed, over a paged latent cache.

Absorbed MLA attends every query head to the same per-token latent vector k (kv_lora_rank
latent dims, then rope_dim rotary dims: D = kv_lora_rank + rope_dim), as key (all D) and
as value (its first kv_lora_rank dims): out[h] = softmax(q[h] . k * scale) @ k[:, :lora].
The cache is one "KV head" that every head shares, so what a decode step costs is reading
that latent cache, and the point of this kernel is to read it once for many heads.

Grid (sequence, head block, split). A program takes up to HEAD_BLOCK (16) query heads
of one sequence as a [16, D] tile and walks its split's share of the context in tiles
of TILE tokens gathered through the block table (any block size): each latent tile
[TILE, D] is loaded once and serves all 16 heads (two tl.dot calls for q . k, one for
p @ k), with an online softmax in float32. D is not a power of two in real models
(512 + 64 = 576), so the lora and rope ranges are two separately padded, masked tiles
(LORA, ROPE constexprs): padding 576 to 1024 would nearly double the work.

The cache is the layer view of engine/kv_cache/layout.py, [num_blocks, 2, block_size, 1,
D] with plane stride 0 (K and V are the same latent). It is indexed by its block and
slot strides and only plane 0 is read; it is never .view()ed.

Split-KV is decode_attention's: split j covers tokens [j * split_tokens, (j + 1) *
split_tokens) (the last split takes any remainder), each writes an unnormalised
partial (acc, max, sum) and _mla_reduce_kernel merges them, so few long sequences still
fill the GPU. Boundaries are fixed in tokens, so the result depends only on the
context, not on the split count. An empty context (seq_len 0, a padding row) yields
zeros rather than 0/0.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.common import (
    FP8_DTYPES,
    SUPPORTED_DTYPES,
    LaunchConfig,
    check_index,
    dot_precision,
    native_dots,
    next_power_of_2,
)

HEAD_BLOCK = 16  # query heads per program (tl.dot needs >= 16 rows)
SPLIT_TOKENS = 512  # context tokens per split
# Untuned guesses for the GPU (no GPU run has timed them yet): a [32, 512] 16-bit latent
# tile plus the [16, 512] fp32 accumulator fit four warps' registers, two stages of it
# shared memory; float32 tiles are twice the bytes, so half the tokens. The interpreter
# runs 16-token tiles so that the tests' short contexts still span several tiles.
GPU_CONFIG = LaunchConfig(block_n=32, block_m=HEAD_BLOCK, num_warps=4, num_stages=2)
GPU_FP32_CONFIG = LaunchConfig(block_n=16, block_m=HEAD_BLOCK, num_warps=4, num_stages=2)
CPU_CONFIG = LaunchConfig(block_n=16, block_m=HEAD_BLOCK, num_warps=4, num_stages=1)


def default_config(device: torch.device, dtype: torch.dtype = torch.bfloat16) -> LaunchConfig:
    if device.type != "cuda":
        return CPU_CONFIG
    return GPU_FP32_CONFIG if dtype == torch.float32 else GPU_CONFIG


def num_splits_for(max_seq_len: int, split_tokens: int = SPLIT_TOKENS) -> int:
    """Splits that give every context up to max_seq_len its fixed-size splits."""
    return max(1, -(-max_seq_len // split_tokens))


@triton.jit
def _mla_attend(q_lora, q_rope, cache_ptr, table, seq_len, dl, dr, first, last, scale,
                stride_c_block, stride_c_slot,
                LORA_DIM: tl.constexpr, ROPE_DIM: tl.constexpr, HEADS: tl.constexpr,
                LORA: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr,
                PRECISION: tl.constexpr, NATIVE: tl.constexpr):
    """Unnormalised (max, sum, acc) of the head block over the context tiles [first, last)."""
    m = tl.full([HEADS], float("-inf"), tl.float32)
    l = tl.zeros([HEADS], tl.float32)
    acc = tl.zeros([HEADS, LORA], tl.float32)
    t = tl.arange(0, TILE)
    lora_mask = dl[None, :] < LORA_DIM
    rope_mask = dr[None, :] < ROPE_DIM
    for tile in range(first, last):
        pos = tile * TILE + t
        valid = pos < seq_len
        block = tl.load(table + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
        # Plane 0 of the latent; slots past the context may hold anything (NaN): masked.
        row = cache_ptr + block * stride_c_block + (pos % BLOCK_SIZE).to(tl.int64) * stride_c_slot
        k_lora = tl.load(row[:, None] + dl[None, :], mask=valid[:, None] & lora_mask, other=0.0)
        k_rope = tl.load(row[:, None] + LORA_DIM + dr[None, :], mask=valid[:, None] & rope_mask, other=0.0)
        k_lora = k_lora.to(q_lora.dtype)  # float32 unless NATIVE; an fp8 cache widened (exact)
        k_rope = k_rope.to(q_lora.dtype)
        s = tl.dot(q_lora, tl.trans(k_lora), input_precision=PRECISION)
        s = tl.dot(q_rope, tl.trans(k_rope), acc=s, input_precision=PRECISION) * scale
        s = tl.where(valid[None, :], s, float("-inf"))
        # Every tile in [0, num_tiles) holds a valid position: each max is finite from the first.
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        l = l * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(k_lora.dtype), k_lora, input_precision=PRECISION)
        m = m_new
    return m, l, acc


@triton.jit
def _mla_decode_kernel(out_ptr, part_acc_ptr, part_max_ptr, part_sum_ptr,
                       q_ptr, cache_ptr, block_tables_ptr, seq_lens_ptr,
                       stride_q_seq, stride_q_head, stride_o_seq, stride_o_head,
                       stride_c_block, stride_c_slot, stride_bt, scale, num_heads, num_splits,
                       LORA_DIM: tl.constexpr, ROPE_DIM: tl.constexpr, LORA: tl.constexpr,
                       ROPE: tl.constexpr, HEADS: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                       TILE: tl.constexpr, TILES_PER_SPLIT: tl.constexpr, SPLIT: tl.constexpr,
                       PRECISION: tl.constexpr, NATIVE: tl.constexpr):
    seq = tl.program_id(0)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    num_tiles = tl.cdiv(seq_len, TILE)
    used = tl.minimum(num_splits, tl.cdiv(num_tiles, TILES_PER_SPLIT))
    heads = tl.program_id(1) * HEADS + tl.arange(0, HEADS)
    hmask = heads < num_heads
    dl = tl.arange(0, LORA)
    dr = tl.arange(0, ROPE)
    q_row = q_ptr + seq.to(tl.int64) * stride_q_seq + heads[:, None] * stride_q_head
    q_lora = tl.load(q_row + dl[None, :], mask=hmask[:, None] & (dl[None, :] < LORA_DIM), other=0.0)
    q_rope = tl.load(q_row + LORA_DIM + dr[None, :], mask=hmask[:, None] & (dr[None, :] < ROPE_DIM), other=0.0)
    if not NATIVE:
        q_lora = q_lora.to(tl.float32)
        q_rope = q_rope.to(tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    first = split * TILES_PER_SPLIT
    last = num_tiles
    if split < num_splits - 1:
        last = tl.minimum(first + TILES_PER_SPLIT, num_tiles)
    m, l, acc = _mla_attend(q_lora, q_rope, cache_ptr, table, seq_len, dl, dr, first, last, scale,
                            stride_c_block, stride_c_slot, LORA_DIM, ROPE_DIM, HEADS, LORA,
                            BLOCK_SIZE, TILE, PRECISION, NATIVE)
    if SPLIT:
        # Partials [seqs, heads, splits(, LORA_DIM)]; splits past the context store nothing.
        part = (seq * num_heads + heads) * num_splits + split
        smask = hmask & (split < used)
        tl.store(part_max_ptr + part, m, mask=smask)
        tl.store(part_sum_ptr + part, l, mask=smask)
        tl.store(part_acc_ptr + part[:, None].to(tl.int64) * LORA_DIM + dl[None, :], acc,
                 mask=smask[:, None] & (dl[None, :] < LORA_DIM))
    else:
        out = acc / tl.where(l > 0, l, 1.0)[:, None]  # an empty context: zeros
        tl.store(out_ptr + seq.to(tl.int64) * stride_o_seq + heads[:, None] * stride_o_head + dl[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=hmask[:, None] & (dl[None, :] < LORA_DIM))


@triton.jit
def _mla_reduce_kernel(out_ptr, part_acc_ptr, part_max_ptr, part_sum_ptr, seq_lens_ptr,
                       stride_o_seq, stride_o_head, num_heads, num_splits, split_tokens,
                       LORA_DIM: tl.constexpr, LORA: tl.constexpr, SPLITS_PAD: tl.constexpr):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    # The splits this context reaches; masked lanes read what an empty split would hold.
    used = tl.minimum(num_splits, tl.cdiv(tl.load(seq_lens_ptr + seq), split_tokens))
    s = tl.arange(0, SPLITS_PAD)
    d = tl.arange(0, LORA)
    part = (seq * num_heads + head) * num_splits + s
    smask = s < used
    m = tl.load(part_max_ptr + part, mask=smask, other=float("-inf"))
    l = tl.load(part_sum_ptr + part, mask=smask, other=0.0)
    acc = tl.load(part_acc_ptr + part[:, None].to(tl.int64) * LORA_DIM + d[None, :],
                  mask=smask[:, None] & (d[None, :] < LORA_DIM), other=0.0)
    # Finite even when no split ran (an empty context), so -inf - m_all stays -inf, not NaN.
    m_all = tl.maximum(tl.max(m, 0), -1.0e30)
    w = tl.where(smask & (l > 0), tl.exp(m - m_all), 0.0)
    total = tl.sum(l * w, 0)
    out = tl.sum(acc * w[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + seq.to(tl.int64) * stride_o_seq + head * stride_o_head + d,
             out.to(out_ptr.dtype.element_ty), mask=d < LORA_DIM)


def check_latent_cache(layer_cache: torch.Tensor, kv_lora_rank: int) -> tuple[int, int]:
    """One layer's view of the latent cache, [num_blocks, 2, block_size, 1, D], both
    planes the same memory. Returns (block_size, D)."""
    if layer_cache.dim() != 5 or layer_cache.shape[1] != 2 or layer_cache.shape[3] != 1:
        raise ValueError(f"latent cache must be [num_blocks, 2, block_size, 1, D], got {tuple(layer_cache.shape)}")
    if layer_cache.stride(1) != 0:
        raise ValueError(f"latent cache planes must alias (plane stride 0, layout.layer_view of a "
                         f"1-plane cache), strides {layer_cache.stride()}")
    if layer_cache.dtype not in SUPPORTED_DTYPES + FP8_DTYPES:
        raise ValueError(f"unsupported latent cache dtype {layer_cache.dtype}")
    if layer_cache.stride(-1) != 1:
        raise ValueError(f"latent cache D must be contiguous, strides {layer_cache.stride()}")
    dim = layer_cache.shape[-1]
    if not 0 < kv_lora_rank < dim:
        raise ValueError(f"kv_lora_rank must be in [1, D) to leave a rope part, got {kv_lora_rank} for D={dim}")
    return layer_cache.shape[2], dim


def _check_rows(name: str, t: torch.Tensor, shape: tuple[int, int, int], cache: torch.Tensor) -> None:
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} must be [batch, heads, {shape[2]}] = {list(shape)}, got {tuple(t.shape)}")
    if t.stride(-1) != 1:
        raise ValueError(f"{name} last dimension must be contiguous, strides {t.stride()}")
    if t.device != cache.device:
        raise ValueError(f"{name} is on {t.device}, the latent cache on {cache.device}")
    if t.dtype != cache.dtype and not (cache.dtype in FP8_DTYPES and t.dtype in SUPPORTED_DTYPES):
        raise ValueError(f"{name} is {t.dtype}, the latent cache {cache.dtype}")


def mla_decode_attention(out: torch.Tensor, query: torch.Tensor, layer_cache: torch.Tensor,
                         block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                         kv_lora_rank: int, num_splits: int = 1, split_tokens: int = SPLIT_TOKENS,
                         config: LaunchConfig | None = None) -> None:
    """out[b, h] = softmax(query[b, h] . k * scale) @ k[:, :kv_lora_rank], k the
    seq_lens[b] latent vectors of sequence b (its blocks in block_tables[b]).

    out:          [B, H, kv_lora_rank], query [B, H, D] (cache dtype, last dim contiguous)
    layer_cache:  [num_blocks, 2, block_size, 1, D], plane stride 0 (layout.layer_view)
    block_tables: [B, max_blocks] int32; seq_lens [B] int32, the current token included
    num_splits:   num_splits_for(longest context) fills the GPU for few long sequences;
                  the result does not depend on it as long as it covers every context
    """
    block_size, dim = check_latent_cache(layer_cache, kv_lora_rank)
    num_seqs = query.shape[0] if query.dim() == 3 else -1
    num_heads = query.shape[1] if query.dim() == 3 else -1
    _check_rows("query", query, (num_seqs, num_heads, dim), layer_cache)
    _check_rows("out", out, (num_seqs, num_heads, kv_lora_rank), layer_cache)
    device = layer_cache.device
    check_index("block_tables", block_tables, 2, torch.int32, device, num_seqs)
    check_index("seq_lens", seq_lens, 1, torch.int32, device, num_seqs)
    config = config or default_config(device, query.dtype)
    tile = config.block_n
    if num_splits < 1 or split_tokens < tile or split_tokens % tile:
        raise ValueError(f"need num_splits >= 1 and split_tokens a multiple of the {tile}-token "
                         f"tile, got {num_splits} and {split_tokens}")
    if num_seqs == 0 or num_heads == 0:
        return
    lora_pad = max(16, next_power_of_2(kv_lora_rank))
    common = dict(LORA_DIM=kv_lora_rank, ROPE_DIM=dim - kv_lora_rank, LORA=lora_pad,
                  ROPE=max(16, next_power_of_2(dim - kv_lora_rank)), HEADS=HEAD_BLOCK,
                  BLOCK_SIZE=block_size, TILE=tile, TILES_PER_SPLIT=split_tokens // tile,
                  PRECISION=dot_precision(query.dtype), NATIVE=native_dots(layer_cache, query),
                  num_warps=config.num_warps, num_stages=config.num_stages)
    grid = (num_seqs, triton.cdiv(num_heads, HEAD_BLOCK), num_splits)
    strides = (query.stride(0), query.stride(1), out.stride(0), out.stride(1), layer_cache.stride(0),
               layer_cache.stride(2), block_tables.stride(0))
    if num_splits == 1:
        _mla_decode_kernel[grid](out, out, out, out, query, layer_cache, block_tables, seq_lens, *strides,
                                 scale, num_heads, 1, SPLIT=False, **common)
        return
    part_acc = torch.empty((num_seqs, num_heads, num_splits, kv_lora_rank), dtype=torch.float32, device=device)
    part_max = torch.empty((num_seqs, num_heads, num_splits), dtype=torch.float32, device=device)
    part_sum = torch.empty_like(part_max)
    _mla_decode_kernel[grid](out, part_acc, part_max, part_sum, query, layer_cache, block_tables, seq_lens,
                             *strides, scale, num_heads, num_splits, SPLIT=True, **common)
    _mla_reduce_kernel[(num_seqs, num_heads)](out, part_acc, part_max, part_sum, seq_lens, out.stride(0),
                                              out.stride(1), num_heads, num_splits, split_tokens,
                                              LORA_DIM=kv_lora_rank, LORA=lora_pad,
                                              SPLITS_PAD=next_power_of_2(num_splits))


def mla_decode_reference(query: torch.Tensor, layer_cache: torch.Tensor, block_tables: torch.Tensor,
                         seq_lens: torch.Tensor, scale: float, kv_lora_rank: int) -> torch.Tensor:
    """The kernel's oracle in plain torch, float32: [B, H, kv_lora_rank]. Reads only
    each sequence's first seq_len slots (plane 0); an empty context gives zeros."""
    num_seqs, num_heads, _ = query.shape
    block_size = layer_cache.shape[2]
    out = torch.zeros(num_seqs, num_heads, kv_lora_rank, dtype=torch.float32, device=query.device)
    for b in range(num_seqs):
        n = int(seq_lens[b])
        if n == 0:
            continue
        pos = torch.arange(n, device=layer_cache.device)
        blocks = block_tables[b].long()[pos // block_size]
        k = layer_cache[blocks, 0, pos % block_size, 0].float()  # [n, D]
        p = (query[b].float() @ k.T * scale).softmax(-1)  # [H, n]
        out[b] = p @ k[:, :kv_lora_rank]
    return out
