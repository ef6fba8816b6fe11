"""The C layer ops for float32 on CPU (engine/model/cpu_ops.py) against the torch ops
they replace, and the model's choice of ops."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from engine import LLM, SamplingParams
from engine.model import cpu_ops, llama
from engine.model.fused_ops import fused_ops
from engine.model.norm import RMSNorm
from engine.model.rope import RotaryEmbedding, apply_rotary
from engine.native import compiler, has_avx2_fma

# With AVX2/FMA and a compiler the C file must build: a build error fails these tests, never skips them.
pytestmark = pytest.mark.skipif(compiler() is None or not has_avx2_fma(), reason="no AVX2/FMA or no C compiler")


# 70 rows: over the threshold where the C loops split rows across threads.
@pytest.mark.parametrize("rows", [0, 1, 5, 70])
@pytest.mark.parametrize("with_residual", [False, True])
def test_add_rms_norm_matches_the_torch_path(rows: int, with_residual: bool) -> None:
    torch.manual_seed(rows)
    norm = RMSNorm(96, 1e-5)
    norm.weight.data = torch.randn(96)
    x = torch.randn(rows, 128)[:, :96]  # rows of stride 128
    residual = torch.randn(rows, 96) if with_residual else None
    with torch.inference_mode():
        out, new_residual = cpu_ops.add_rms_norm(x, norm.weight, norm.eps, residual)
        summed = x + residual if with_residual else x
        assert torch.equal(new_residual, summed)
        # Only the sum of squares is accumulated differently (double vs torch's float lanes).
        torch.testing.assert_close(out, norm(summed), rtol=2e-6, atol=1e-6)


@pytest.mark.parametrize("tokens", [0, 3, 70])
def test_rotary_is_bit_equal_to_the_torch_path(tokens: int) -> None:
    torch.manual_seed(tokens)
    heads, kv_heads, dim = 9, 3, 64
    rope = RotaryEmbedding(dim, 4096, 10000.0, None, "cpu")
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim)  # q and k as views of one buffer
    q = qkv[:, :heads * dim].view(tokens, heads, dim)
    k = qkv[:, heads * dim:(heads + kv_heads) * dim].view(tokens, kv_heads, dim)
    positions = torch.randint(0, 4096, (tokens,))
    want_q, want_k = apply_rotary(q, k, *rope.lookup(positions, torch.float32))
    v_before = qkv[:, (heads + kv_heads) * dim:].clone()
    cpu_ops.rotary_(q, k, rope.cos, rope.sin, positions)
    assert torch.equal(q, want_q) and torch.equal(k, want_k)
    assert torch.equal(qkv[:, (heads + kv_heads) * dim:], v_before)  # v untouched


@pytest.mark.parametrize("rows", [0, 2, 40])
def test_silu_and_mul_matches_the_torch_path(rows: int) -> None:
    torch.manual_seed(rows)
    gate_up = torch.randn(rows, 2 * 84 + 16)[:, :168] * 4  # rows of stride 184; 84 = 10 x 8 lanes + 4
    # Past exp's range both ways, in vector lanes: -1e30 must give -0, not a tiny number.
    gate_up[:, :8] = torch.tensor([-1e30, -100.0, -88.5, -87.0, 88.0, 100.0, 1e30, -float("inf")])
    gate_up[:, 84 + 7] = 1.0  # up of the -inf gate: silu(-inf) * 1 is NaN in torch too
    gate, up = gate_up.split(84, dim=-1)
    out = cpu_ops.silu_and_mul(gate_up)
    torch.testing.assert_close(out, F.silu(gate) * up, rtol=1e-6, atol=1e-6, equal_nan=True)
    if rows:
        assert (out[:, 0] == 0).all() and out[:, 7].isnan().all()


def test_silu_and_mul_keeps_nan() -> None:
    gate_up = torch.ones(1, 32)
    gate_up[0, 3] = float("nan")
    assert cpu_ops.silu_and_mul(gate_up)[0].isnan().tolist() == [i == 3 for i in range(16)]


def test_rotary_refuses_positions_outside_its_tables() -> None:
    rope = RotaryEmbedding(16, 128, 10000.0, None, "cpu")
    q, k = torch.randn(3, 2, 16), torch.randn(3, 1, 16)
    before = q.clone()
    for positions in ([0, 128, 5], [-1, 0, 0], [0, -10**9, 0]):
        with pytest.raises(ValueError, match=r"1 of 3 positions are outside the rotary tables \[0, 128\)"):
            cpu_ops.rotary_(q, k, rope.cos, rope.sin, torch.tensor(positions))
    assert torch.equal(q, before)  # nothing rotated


def test_bad_inputs_are_refused_by_name() -> None:
    w = torch.ones(8)
    with pytest.raises(ValueError, match="float32 on CPU"):
        cpu_ops.add_rms_norm(torch.randn(2, 8).double(), w.double(), 1e-5)
    with pytest.raises(ValueError, match="residual must match x"):
        cpu_ops.add_rms_norm(torch.randn(2, 8), w, 1e-5, torch.randn(3, 8))
    with pytest.raises(ValueError, match="need x"):
        cpu_ops.add_rms_norm(torch.randn(8), w, 1e-5)
    with pytest.raises(ValueError, match="int64 positions"):
        cpu_ops.rotary_(torch.randn(2, 4, 8), torch.randn(2, 2, 8), torch.randn(16, 8), torch.randn(16, 8),
                        torch.zeros(2, dtype=torch.int32))
    with pytest.raises(ValueError, match="even D"):
        cpu_ops.rotary_(torch.randn(2, 4, 7), torch.randn(2, 2, 7), torch.randn(16, 7), torch.randn(16, 7),
                        torch.zeros(2, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"gate_up \[T, 2I\]"):
        cpu_ops.silu_and_mul(torch.randn(2, 7))


def test_the_model_picks_c_ops_for_float32_on_cpu_only() -> None:
    assert fused_ops(torch.zeros(1)) is not None
    assert fused_ops(torch.zeros(1, dtype=torch.bfloat16)) is None


@pytest.mark.parametrize("arch", ["llama", "olmo2", "phi3"])  # OLMo 2: its own fused layer; Phi-3: partial rotary
def test_engine_tokens_identical_with_c_ops_and_with_torch_ops(tiny_models: dict[str, Path], arch: str,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=3)
    prompts = [list(range(3, 40)), [7, 8, 9]]
    fused = LLM(str(tiny_models[arch])).generate(prompts, params, use_tqdm=False)
    monkeypatch.setattr(llama, "fused_ops", lambda x: None)
    plain = LLM(str(tiny_models[arch])).generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in fused] == [o.token_ids for o in plain]
    for f, p in zip(fused, plain):
        for a, b in zip(f.logprobs, p.logprobs):
            assert dict(a.top) == pytest.approx(dict(b.top), abs=1e-4)
