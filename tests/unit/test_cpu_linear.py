"""oneDNN-prepacked linears: same numbers as nn.Linear, same tokens end to end."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from engine import LLM, SamplingParams
from engine.model.cpu_linear import PackedLinear, prepack_linears, prepack_supported

pytestmark = pytest.mark.skipif(not prepack_supported("cpu", torch.float32), reason="no oneDNN")


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 7, 64, 300])
def test_packed_linear_matches_linear(bias: bool, rows: int) -> None:
    torch.manual_seed(0)
    linear = nn.Linear(96, 200, bias=bias)
    x = torch.randn(rows, 96)
    with torch.inference_mode():
        torch.testing.assert_close(PackedLinear(linear)(x), linear(x), rtol=1e-5, atol=1e-5)


def test_prepack_replaces_every_linear() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Sequential(nn.Linear(4, 2)))
    assert prepack_linears(model) == 2
    assert not any(isinstance(m, nn.Linear) for m in model.modules())


def test_engine_tokens_identical_with_and_without_prepack(llama_dir: Path) -> None:
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    prompts = [list(range(3, 40)), [7, 8, 9]]
    packed = LLM(str(llama_dir)).generate(prompts, params, use_tqdm=False)
    plain = LLM(str(llama_dir), prepack_cpu_weights=False).generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in packed] == [o.token_ids for o in plain]
    assert isinstance(LLM(str(llama_dir)).core.model.lm_head, PackedLinear)
