"""The model's fused 16-bit path (engine/kernels/norm_rope.py, used on a GPU) against its
torch path, forced on CPU under the Triton interpreter: Llama's layer, OLMo 2's (norms
after the sublayers) and Phi-3's (rotary over part of each head)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from engine.model import llama
from engine.model.fused_ops import triton_ops
from engine.model.rope import RotaryEmbedding, apply_rotary

PROMPTS = [[5, 17, 42, 99, 3, 250, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18], [300, 2, 77]]


def first_step_logprobs(model_dir: Path) -> list[dict[int, float]]:
    llm = LLM(str(model_dir), dtype="float16", num_kv_blocks=16, enable_prefix_caching=False)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=1, temperature=0.0, logprobs=5), use_tqdm=False)
    return [dict(o.logprobs[0].top) for o in outs]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("arch", ["llama", "olmo2", "phi3"])
def test_fused_norms_and_rotary_match_the_torch_path(tiny_models: dict[str, Path], monkeypatch, arch: str) -> None:
    expected = first_step_logprobs(tiny_models[arch])
    monkeypatch.setattr(llama, "fused_ops", lambda x: triton_ops())
    got = first_step_logprobs(tiny_models[arch])
    for want, have in zip(expected, got):
        assert next(iter(have)) == next(iter(want))  # the same greedy token
        # fp16 rounds differently in the fused rotary: near-tied alternatives may swap.
        shared = want.keys() & have.keys()
        assert len(shared) >= 4
        assert [have[t] for t in shared] == pytest.approx([want[t] for t in shared], abs=2e-2)


@pytest.mark.parametrize("width", [8, 12])  # 12: no power-of-two half, turned in torch (Phi-3-mini's 96)
def test_rotary_of_any_width_turns_the_first_dims_only(width: int) -> None:
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(5, 4, 16, generator=g).half(), torch.randn(5, 2, 16, generator=g).half()
    rope, positions = RotaryEmbedding(width, 64, 10000.0, None, "cpu"), torch.tensor([0, 3, 9, 17, 63])
    want_q, want_k = apply_rotary(q.float(), k.float(), *rope.lookup(positions, torch.float32))
    triton_ops().rotary_(q[..., :width], k[..., :width], rope.cos, rope.sin, positions)
    assert torch.equal(q[..., width:], want_q[..., width:].half())  # passed through untouched
    torch.testing.assert_close(q.float(), want_q, atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(k.float(), want_k, atol=2e-3, rtol=2e-3)
