"""The attention inner steps both kernels share: gathering a tile of keys and values
through the block table, and folding it into a running (max, sum, accumulator),
flash-attention style. The softmax and the accumulators are float32; with NATIVE
(common.native_dots) the two products take 16-bit K/V as loaded."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def load_kv_tile(cache_ptr, table, pos, valid, kv_head, d, stride_c_block, stride_c_kv,
                 stride_c_slot, stride_c_head, BLOCK_SIZE: tl.constexpr, NATIVE: tl.constexpr):
    """K and V [N, D] for positions `pos` [N] of one sequence (block ids at `table`),
    in the cache's dtype if NATIVE (an fp8 cache's are widened by the dots), else
    float32; positions not `valid` read as 0.
    Slots past the context may hold anything, even NaN: masked, never read."""
    block = tl.load(table + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
    kv = (cache_ptr + block[:, None] * stride_c_block + (pos % BLOCK_SIZE)[:, None] * stride_c_slot
          + kv_head * stride_c_head + d[None, :])
    k = tl.load(kv, mask=valid[:, None], other=0.0)
    v = tl.load(kv + stride_c_kv, mask=valid[:, None], other=0.0)
    if not NATIVE:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    return k, v


@triton.jit
def online_softmax_step(q, k, v, visible, m, l, acc, scale, softcap, PRECISION: tl.constexpr,
                        SOFTCAP: tl.constexpr):
    """q [M, D]; k, v [N, D] in q's dtype or fp8 (widened to it here: exact); visible
    [M, N] (or broadcastable); m, l [M]; acc [M, D] float32. SOFTCAP: scores x are
    capped to softcap * tanh(x / softcap) first (Gemma 2; tanh through exp, which every
    Triton backend and the interpreter have: 1 - 2 / (e^2y + 1), exact at both ends).

    Masked keys get probability 0. A row that has seen no key yet (a sliding window
    starts past this tile for it) keeps max -inf, sum 0 and acc 0: its exponents are
    taken against 0, not -inf, which would give NaN. Every row must see at least one
    key overall."""
    s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=PRECISION) * scale
    if SOFTCAP:
        s = softcap * (1.0 - 2.0 / (tl.exp(2.0 * s / softcap) + 1.0))
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, 1))
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m - m_ref)
    p = tl.exp(s - m_ref[:, None])
    l = l * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=PRECISION)
    return m_new, l, acc
