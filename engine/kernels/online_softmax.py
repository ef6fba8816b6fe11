"""The attention inner step both kernels share: one tile of keys and values folded
into a running (max, sum, accumulator), flash-attention style, in float32."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def online_softmax_step(q, k, v, visible, m, l, acc, scale, PRECISION: tl.constexpr):
    """q [M, D]; k, v [N, D]; visible [M, N] (or broadcastable); m, l [M]; acc [M, D].

    Every row must see at least one key overall (its max becomes finite in the first
    tile it sees one); masked keys get probability 0."""
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, 1))
    alpha = tl.exp(m - m_new)
    p = tl.exp(s - m_new[:, None])
    l = l * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=PRECISION)
    return m_new, l, acc
