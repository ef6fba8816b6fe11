"""The fused RMSNorm and rotary kernels against the model's torch ops, under the
Triton interpreter (fp32 and fp16; bf16 arithmetic is wrong in the interpreter)."""

from __future__ import annotations

import pytest
import torch

from engine.kernels.norm_rope import add_rms_norm, rotary_
from engine.model.norm import RMSNorm
from engine.model.rope import RotaryEmbedding, apply_rotary

TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=2e-3, rtol=2e-3)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("hidden", [64, 96])  # 96: a row shorter than the kernel's block
def test_add_rms_norm_matches_the_model(dtype: torch.dtype, hidden: int) -> None:
    g = torch.Generator().manual_seed(0)
    norm = RMSNorm(hidden, 1e-5)
    norm.weight.data = torch.randn(hidden, generator=g)
    norm = norm.to(dtype)
    x = torch.randn(5, hidden, generator=g).to(dtype)
    residual = torch.randn(5, hidden, generator=g).to(dtype)
    out, res = add_rms_norm(x, norm.weight, 1e-5, residual)
    torch.testing.assert_close(res, x + residual, atol=0, rtol=0)
    torch.testing.assert_close(out, norm(x + residual), **TOL[dtype])
    out, same = add_rms_norm(x, norm.weight, 1e-5)
    assert same is x
    torch.testing.assert_close(out, norm(x), **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("hq,hk", [(4, 2), (3, 1)])  # 3 heads: padded to 4 in the kernel
def test_rotary_matches_the_model(dtype: torch.dtype, hq: int, hk: int) -> None:
    g = torch.Generator().manual_seed(1)
    rope = RotaryEmbedding(32, 64, 10000.0, None, "cpu")
    positions = torch.tensor([0, 5, 63, 17])
    qkv = torch.randn(4, (hq + 2 * hk) * 32, generator=g).to(dtype)  # q and k are strided views, as in the model
    q, k, _ = qkv.split([hq * 32, hk * 32, hk * 32], dim=-1)
    q, k = q.view(4, hq, 32), k.view(4, hk, 32)
    expected = apply_rotary(q.float(), k.float(), *rope.lookup(positions, torch.float32))
    rotary_(q, k, rope.cos, rope.sin, positions)
    torch.testing.assert_close(q.float(), expected[0], **TOL[dtype])
    torch.testing.assert_close(k.float(), expected[1], **TOL[dtype])


def test_bad_inputs_are_named() -> None:
    with pytest.raises(ValueError, match="need x \\[T, H\\]"):
        add_rms_norm(torch.zeros(2, 8), torch.ones(4), 1e-5)
    with pytest.raises(ValueError, match="residual must match x"):
        add_rms_norm(torch.zeros(2, 8), torch.ones(8), 1e-5, torch.zeros(2, 8, dtype=torch.float16))
    with pytest.raises(ValueError, match="fp32 tables"):
        rotary_(torch.zeros(2, 2, 8), torch.zeros(2, 1, 8), torch.zeros(4, 8, dtype=torch.float16),
                torch.zeros(4, 8, dtype=torch.float16), torch.zeros(2, dtype=torch.int64))
