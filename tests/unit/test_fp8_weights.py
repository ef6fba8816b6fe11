"""fp8 weights (engine/model/fp8_linear.py): FP8 checkpoints as compressed-tensors and
fbgemm write them (per-tensor and per-channel scales) and online `quantization: fp8`,
checked weight for weight and token for token against what they must equal; the
quantization kinds that cannot load are refused by name."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from engine import LLM, SamplingParams
from engine.model.config import checkpoint_quantization
from engine.model.fp8_linear import FP8, FP8_MAX, Fp8Linear
from tests.fidelity.test_hf_fidelity import random_prompts

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
PROMPTS = random_prompts([5, 23, 40], seed=3)
QUANTIZED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
CT = {"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
      "config_groups": {"group_0": {"targets": ["Linear"], "weights": {"type": "float", "num_bits": 8,
                                                                      "strategy": "channel"}}}}


def test_checkpoint_quantization_kinds() -> None:
    assert checkpoint_quantization(None) is None
    assert checkpoint_quantization(CT) == "fp8"
    assert checkpoint_quantization({"quant_method": "fbgemm_fp8"}) == "fp8"
    assert checkpoint_quantization({"quant_method": "fp8", "activation_scheme": "static"}) == "fp8"
    with pytest.raises(ValueError, match="block-wise weight scales"):
        checkpoint_quantization({"quant_method": "fp8", "weight_block_size": [128, 128]})
    int4 = json.loads(json.dumps(CT))
    int4["config_groups"]["group_0"]["weights"].update(type="int", num_bits=4)
    with pytest.raises(ValueError, match="only float8 weights"):
        checkpoint_quantization(int4)
    with pytest.raises(ValueError, match="unsupported checkpoint quantization 'awq'"):
        checkpoint_quantization({"quant_method": "awq"})
    # An fp8 KV cache's scales and no weight groups: unquantized weights.
    assert checkpoint_quantization({"quant_method": "compressed-tensors", "config_groups": {},
                                    "kv_cache_scheme": {"type": "float", "num_bits": 8}}) is None


def test_fp8_linear_quantizes_per_channel_and_dequantizes_in_the_call() -> None:
    torch.manual_seed(0)
    linear = nn.Linear(64, 32, bias=True)
    linear.weight.data[3] *= 100  # one loud channel must not coarsen the others
    q = Fp8Linear.quantize(linear)
    assert q.weight.dtype == FP8 and q.weight_scale.shape == (32,)
    assert torch.equal(q.weight_scale, linear.weight.abs().amax(1).detach() / FP8_MAX)
    w = linear.weight.detach()
    rel = ((q.dequantized(torch.float32) - w).abs() / w.abs().amax(1, keepdim=True)).max()
    assert rel <= 2 ** -4, rel  # e4m3: 3 mantissa bits, half an ulp at the channel's top
    x = torch.randn(5, 64)
    torch.testing.assert_close(q(x), F.linear(x, q.dequantized(torch.float32), linear.bias), atol=0, rtol=0)


def fp8_checkpoint(src: Path, out: Path, per_tensor: bool) -> Path:
    """`src` with its decoder linears in float8 and their weight scales (and input scales,
    which the engine ignores), as compressed-tensors stores them. Per-channel scales are
    what online quantization computes, so the two must load the same weights."""
    shutil.copytree(src, out)
    files = sorted(out.glob("*.safetensors"))
    assert len(files) == 1
    tensors = load_file(files[0])
    for name in [n for n in tensors if n.endswith(".weight") and any(f".{p}." in n for p in QUANTIZED)]:
        w = tensors[name].float()
        amax = w.abs().amax() if per_tensor else w.abs().amax(dim=1)
        scale = (amax / FP8_MAX).clamp(min=torch.finfo(torch.float32).tiny)
        tensors[name] = (w / (scale if per_tensor else scale[:, None])).clamp(-FP8_MAX, FP8_MAX).to(FP8)
        base = name.removesuffix(".weight")
        tensors[f"{base}.weight_scale"] = scale.reshape(1) if per_tensor else scale[:, None].contiguous()
        tensors[f"{base}.input_scale"] = torch.ones(1)
    save_file(tensors, files[0])
    config = json.loads((out / "config.json").read_text())
    qc = json.loads(json.dumps(CT))
    qc["config_groups"]["group_0"]["weights"]["strategy"] = "tensor" if per_tensor else "channel"
    (out / "config.json").write_text(json.dumps({**config, "quantization_config": qc}))
    return out


def dequantized_checkpoint(fp8_dir: Path, out: Path) -> Path:
    """The fp8 checkpoint's weights dequantized to float32: the unquantized model that an
    fp8 engine computes with."""
    shutil.copytree(fp8_dir, out)
    files = sorted(out.glob("*.safetensors"))
    tensors = load_file(files[0])
    for name in [n for n in tensors if n.endswith(".weight_scale")]:
        base = name.removesuffix(".weight_scale")
        scale = tensors.pop(name).float()
        tensors[f"{base}.weight"] = tensors[f"{base}.weight"].float() * (scale if scale.numel() == 1 else scale)
        tensors.pop(f"{base}.input_scale")
    save_file(tensors, files[0])
    config = json.loads((out / "config.json").read_text())
    config.pop("quantization_config")
    (out / "config.json").write_text(json.dumps(config))
    return out


def greedy(model: Path, **options) -> list[list[int]]:
    llm = LLM(str(model), num_kv_blocks=64, **options)
    return [o.token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def fp8_params(model: Path, **options) -> dict[str, torch.Tensor]:
    llm = LLM(str(model), num_kv_blocks=16, **options)
    mods = [m for m in llm.core.model.modules() if isinstance(m, Fp8Linear)]
    assert len(mods) == 4 * llm.core.model_config.num_layers, "qkv, o, gate_up and down of every layer"
    return {n: p.detach().clone() for n, p in llm.core.model.named_parameters()}


@pytest.mark.timeout(120)
def test_a_per_channel_checkpoint_loads_the_weights_online_quantization_makes(llama_dir: Path,
                                                                             tmp_path: Path) -> None:
    ckpt = fp8_checkpoint(llama_dir, tmp_path / "fp8-channel", per_tensor=False)
    loaded, online = fp8_params(ckpt), fp8_params(llama_dir, quantization="fp8")
    assert loaded.keys() == online.keys()
    for name in loaded:
        a, b = loaded[name], online[name]
        assert a.dtype == b.dtype and torch.equal(a.view(torch.uint8) if a.dtype == FP8 else a,
                                                  b.view(torch.uint8) if b.dtype == FP8 else b), name
    assert greedy(ckpt) == greedy(llama_dir, quantization="fp8")


@pytest.mark.timeout(120)
def test_a_per_tensor_checkpoint_computes_as_its_dequantized_weights(llama_dir: Path, tmp_path: Path) -> None:
    ckpt = fp8_checkpoint(llama_dir, tmp_path / "fp8-tensor", per_tensor=True)
    plain = dequantized_checkpoint(ckpt, tmp_path / "dequantized")
    # Both multiply with F.linear on the same float32 weights (no prepacked kernel on either side).
    assert greedy(ckpt) == greedy(plain, prepack_cpu_weights=False)
    assert greedy(ckpt) != greedy(llama_dir), "fp8 weights that change no token: quantization did nothing"


@pytest.mark.timeout(180)
def test_fp8_at_tp2_equals_tp1(llama_dir: Path, tmp_path: Path) -> None:
    """Online: row-parallel layers take their channels' amax over both ranks, so the same
    weights. A per-channel checkpoint: each rank's rows get their own channels' scales."""
    tp1 = greedy(llama_dir, quantization="fp8")
    assert greedy(llama_dir, quantization="fp8", tensor_parallel_size=2, num_threads=1) == tp1
    ckpt = fp8_checkpoint(llama_dir, tmp_path / "fp8-channel", per_tensor=False)
    assert greedy(ckpt, tensor_parallel_size=2, num_threads=1) == tp1


def test_fp8_weights_with_nowhere_to_go_are_refused(llama_dir: Path, tmp_path: Path) -> None:
    ckpt = fp8_checkpoint(llama_dir, tmp_path / "fp8", per_tensor=True)
    files = sorted(ckpt.glob("*.safetensors"))
    tensors = load_file(files[0])
    tensors["lm_head.weight" if "lm_head.weight" in tensors else "model.embed_tokens.weight"] = \
        tensors["model.embed_tokens.weight"].to(FP8)
    save_file(tensors, files[0])
    with pytest.raises(ValueError, match="pdserve has no fp8 path for it"):
        LLM(str(ckpt), num_kv_blocks=16)


def test_the_scaled_mm_path_computes_the_dequantized_product() -> None:
    """The CUDA path's arithmetic (per-token activation scales, rowwise on both sides of
    torch._scaled_mm), run here by torch's CPU _scaled_mm: within fp8's rounding of the
    activations of the weight-only product, bias and leading dimensions kept."""
    from engine.model.fp8_linear import _fp8_gemm

    torch.manual_seed(1)
    q = Fp8Linear.quantize(nn.Linear(64, 48, bias=True).to(torch.bfloat16))
    x = torch.randn(2, 5, 64, dtype=torch.bfloat16)
    x[0, 1] *= 50  # a loud token must not coarsen the others: scales are per token
    got = _fp8_gemm(x, q.weight, q.weight_scale, q.bias)
    want = F.linear(x, q.dequantized(torch.bfloat16), q.bias)
    assert got.shape == want.shape and got.dtype == torch.bfloat16
    for token in range(5):
        err = (got[:, token].float() - want[:, token].float()).norm() / want[:, token].float().norm()
        assert err < 0.05, (token, float(err))


def rewrite_checkpoint(ckpt: Path, edit) -> None:
    files = sorted(ckpt.glob("*.safetensors"))
    tensors = load_file(files[0])
    edit(tensors)
    save_file(tensors, files[0])


@pytest.mark.parametrize("case,error", [
    ("no quantization_config", r"fp8 tensor '.*' .* config.json has no quantization_config"),
    ("zero scale", r"weight scale 'model.layers.0.self_attn.q_proj.weight_scale' must be positive and finite"),
    ("nan scale", r"weight scale 'model.layers.0.self_attn.q_proj.weight_scale' must be positive and finite"),
    ("block scales", r"weight scale 'model.layers.0.self_attn.q_proj.weight_scale' has \d+ values for \d+ output "
                     r"channels: per-tensor and per-channel scales only"),
])
def test_a_malformed_fp8_checkpoint_is_refused_by_name(llama_dir: Path, tmp_path: Path, case: str,
                                                        error: str) -> None:
    ckpt = fp8_checkpoint(llama_dir, tmp_path / "fp8", per_tensor=False)
    scale = "model.layers.0.self_attn.q_proj.weight_scale"
    if case == "no quantization_config":
        config = json.loads((ckpt / "config.json").read_text())
        config.pop("quantization_config")
        (ckpt / "config.json").write_text(json.dumps(config))
    elif case == "block scales":
        rewrite_checkpoint(ckpt, lambda t: t.update({scale: torch.ones(2, 2)}))
    else:
        value = 0.0 if case == "zero scale" else float("nan")
        rewrite_checkpoint(ckpt, lambda t: t[scale].view(-1).__setitem__(0, value))
    with pytest.raises(ValueError, match=error):
        LLM(str(ckpt), num_kv_blocks=16)
