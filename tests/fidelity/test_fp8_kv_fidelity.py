"""An fp8 KV cache and fp8 weights against float32 transformers on the demo model,
teacher-forced (agreement.py), within the bounds of tolerances.py; the float32 engine
with the default cache and unquantized weights stays exact on the same texts."""

from __future__ import annotations

import pytest

from cluster.demo_model import DEMO_MODELS, default_models_dir
from engine import LLM
from tests.fidelity.agreement import measure, reference
from tests.fidelity.tolerances import FP8_E5M2_KV, FP8_KV, FP8_W8A8, FP8_WEIGHTS, FP8_WEIGHTS_KV, Bound

MODEL_DIR = default_models_dir() / DEMO_MODELS["smollm2"].dir_name

pytestmark = pytest.mark.skipif(not (MODEL_DIR / "config.json").is_file(),
                                reason="demo model not prepared (make model)")


@pytest.fixture(scope="module")
def hf_reference():
    return reference(MODEL_DIR, LLM(str(MODEL_DIR), num_kv_blocks=64))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("dtype,kv_cache_dtype,quantization,bound", [
    ("float32", "auto", None, Bound(1.0, 1.0, 1e-4)),  # exact: the same tokens, logprobs within rounding
    ("float32", "fp8", None, FP8_KV),
    ("bfloat16", "fp8", None, FP8_KV),
    ("float32", "fp8_e5m2", None, FP8_E5M2_KV),
    ("float32", "auto", "fp8", FP8_WEIGHTS),
    ("bfloat16", "auto", "fp8", FP8_WEIGHTS),
    ("float32", "fp8", "fp8", FP8_WEIGHTS_KV),
])
def test_fp8_agrees_with_float32_hf(hf_reference, dtype: str, kv_cache_dtype: str, quantization: str | None,
                                    bound: Bound) -> None:
    llm = LLM(str(MODEL_DIR), dtype=dtype, kv_cache_dtype=kv_cache_dtype, quantization=quantization,
              num_kv_blocks=64)
    got = measure(llm, hf_reference)
    assert got.top1_all >= bound.top1_all, got
    assert got.top1_confident >= bound.top1_confident, got
    assert got.mean_abs_dlogprob <= bound.mean_abs_dlogprob, got
    if (kv_cache_dtype, quantization) != ("auto", None):
        assert got.mean_abs_dlogprob > 1e-3, "fp8 that changes nothing is not rounding"


@pytest.mark.timeout(300)
def test_the_cuda_w8a8_arithmetic_agrees_with_float32_hf(hf_reference, monkeypatch: pytest.MonkeyPatch) -> None:
    """fp8 weights as CUDA runs them (torch._scaled_mm, activations quantized per token),
    here through torch's CPU _scaled_mm: every linear takes that path."""
    import torch

    from engine.model import fp8_linear

    taken = []

    def always(x: torch.Tensor, out_features: int) -> bool:
        taken.append(x.dtype)
        return True

    monkeypatch.setattr(fp8_linear, "_scaled_mm_ok", always)
    got = measure(LLM(str(MODEL_DIR), dtype="bfloat16", quantization="fp8", num_kv_blocks=64), hf_reference)
    assert taken and set(taken) == {torch.bfloat16}
    assert got.top1_all >= FP8_W8A8.top1_all, got
    assert got.top1_confident >= FP8_W8A8.top1_confident, got
    assert got.mean_abs_dlogprob <= FP8_W8A8.mean_abs_dlogprob, got
