"""Packed CPU linears (the C panel kernel and oneDNN's): nn.Linear's numbers, same tokens
end to end."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from engine import LLM, SamplingParams
from engine.model import cpu_linear
from engine.model.cpu_linear import PackedLinear, PanelLinear, prepack_linears
from engine.native import compiler, has_avx2_fma

# With AVX2/FMA and a compiler the C file must build: a build error fails, never skips.
needs_panel = pytest.mark.skipif(compiler() is None or not has_avx2_fma(), reason="no AVX2/FMA or no C compiler")
needs_onednn = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN")
FORMS = [pytest.param(PanelLinear, marks=needs_panel), pytest.param(PackedLinear, marks=needs_onednn)]


# Rows: decode sizes, the kernel's small/large switch (24), its row block (6) and row
# chunk (192) edges. in 300 > the K chunk (256) and not a multiple of it; out 200 ends
# in a partial 16-column panel.
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 5, 7, 24, 25, 64, 197, 400])
def test_packed_linear_matches_linear(form: type[nn.Module], bias: bool, rows: int) -> None:
    torch.manual_seed(rows)
    linear = nn.Linear(300, 200, bias=bias)
    x = torch.randn(rows, 300)
    with torch.inference_mode():
        torch.testing.assert_close(form(linear)(x), linear(x), rtol=1e-5, atol=1e-5)


@needs_panel
@pytest.mark.parametrize(("in_features", "out_features"), [(1, 1), (7, 15), (255, 17), (257, 16), (513, 33)])
@pytest.mark.parametrize("rows", [1, 30])
def test_panel_linear_odd_shapes(in_features: int, out_features: int, rows: int) -> None:
    """Outputs fewer than a panel (16) or just past one; K below, at and past a K chunk (256)."""
    torch.manual_seed(in_features)
    linear = nn.Linear(in_features, out_features)
    x = torch.randn(rows, in_features + 5)[:, :in_features]
    with torch.inference_mode():
        torch.testing.assert_close(PanelLinear(linear)(x), linear(x), rtol=1e-5, atol=1e-5)


@needs_panel
def test_panel_results_do_not_depend_on_the_thread_count() -> None:
    torch.manual_seed(0)
    layer = PanelLinear(nn.Linear(300, 200))
    x = torch.randn(64, 300)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = layer(x)
        torch.set_num_threads(2)
        assert torch.equal(layer(x), one)
    finally:
        torch.set_num_threads(threads)


@needs_panel
def test_panel_rows_do_not_depend_on_the_batch_or_its_layout() -> None:
    """Every output is summed over k in the same order on every path: a row's result is
    bit-identical alone, in a decode batch, in a prefill batch, and from a strided view."""
    torch.manual_seed(0)
    layer = PanelLinear(nn.Linear(300, 40))
    x = torch.randn(400, 320)[:, :300]  # rows of stride 320
    with torch.inference_mode():
        alone = torch.cat([layer(x[i:i + 1]) for i in (0, 3, 399)])
        for batch in (x[:8], x):
            got = layer(batch)
            rows = [i for i in (0, 3, 399) if i < batch.shape[0]]
            assert torch.equal(got[rows], alone[[(0, 3, 399).index(i) for i in rows]])
        assert layer(x[:0]).shape == (0, 40)


@needs_panel
def test_panel_linear_rejects_what_it_cannot_compute() -> None:
    layer = PanelLinear(nn.Linear(8, 4))
    for bad in (torch.randn(2, 9), torch.randn(2, 8).double(), torch.randn(8), torch.empty(2, 8, device="meta")):
        with pytest.raises(ValueError, match=r"PanelLinear\(8 -> 4\)"):
            layer(bad)


def test_prepack_replaces_every_linear() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Sequential(nn.Linear(4, 2)))
    assert prepack_linears(model) == 2
    assert not any(isinstance(m, nn.Linear) for m in model.modules())


@pytest.mark.parametrize("form", FORMS)
def test_engine_tokens_identical_with_and_without_prepack(llama_dir: Path, form: type[nn.Module],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    if form is PackedLinear:
        monkeypatch.setattr(cpu_linear, "panel_kernel", lambda: None)
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    prompts = [list(range(3, 40)), [7, 8, 9]]
    llm = LLM(str(llama_dir))
    assert isinstance(llm.core.model.lm_head, form)
    packed = llm.generate(prompts, params, use_tqdm=False)
    plain = LLM(str(llama_dir), prepack_cpu_weights=False).generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in packed] == [o.token_ids for o in plain]
