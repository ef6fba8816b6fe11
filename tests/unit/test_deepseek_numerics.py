"""DeepSeek's numerics where they leave float32 (found by review, each against
transformers): the router in float32 at any dtype, V2's rotary embedding rounded once,
checkpoint and config details transformers tolerates."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from engine.model.config import ModelConfig


def test_the_router_stays_float32_in_a_bf16_model_and_routes_as_transformers(moe_models: dict[str, Path]) -> None:
    from transformers import AutoModelForCausalLM

    model = moe_models["deepseek_v3"]
    moe = LLM(str(model), dtype="bfloat16", num_kv_blocks=16).core.model.layers[1].mlp
    assert moe.gate.weight.dtype == moe.e_score_correction_bias.dtype == torch.float32
    router = AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16).model.layers[1].mlp.gate
    x = torch.randn(4096, 64, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    with torch.no_grad():
        experts, weights = moe.route(x)
        _, hf_weights, hf_experts = router(x)
    ours, theirs = experts.sort(dim=-1), hf_experts.sort(dim=-1)
    assert torch.equal(ours.values, theirs.values)  # with the router rounded to bf16: 9 of 4096 differed
    assert weights.dtype == torch.float32  # each expert's output rounds once, after its weight
    torch.testing.assert_close(weights.gather(1, ours.indices), hf_weights.gather(1, theirs.indices))


def test_deepseek_v2_rotates_in_float32_and_rounds_once() -> None:
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import apply_rotary_emb

    from engine.model.config import MLAConfig
    from engine.model.mla import deinterleave, rotate
    from engine.model.rope import RotaryEmbedding

    mla = MLAConfig(None, 32, 16, 64, 16, rope_interleave=True, rope_fp32=True)
    positions = torch.arange(512)
    q = torch.randn(512, 1, 64, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, 64, 2).float() / 64))
    freqs = positions[None, :, None].float() * inv_freq
    hf, _ = apply_rotary_emb(q.transpose(0, 1)[None], q.transpose(0, 1)[None], torch.polar(torch.ones_like(freqs),
                                                                                            freqs))
    rope = RotaryEmbedding(64, 1024, 10000.0, None, "cpu")
    ours, _ = rotate(mla, q, q, rope.lookup(positions, torch.float32))
    differ = (ours != deinterleave(hf[0].transpose(0, 1))).sum().item()
    assert differ <= 4, differ  # 1 of 32,768 by one ulp (its cos/sin vs polar()); in bf16 cos/sin 11,728 did


def test_multi_token_prediction_layers_in_a_checkpoint_are_skipped(moe_models: dict[str, Path],
                                                                    tmp_path: Path) -> None:
    """DeepSeek-V3's checkpoints carry its MTP module as layer num_hidden_layers, which
    transformers ignores."""
    from safetensors.torch import save_file

    model = tmp_path / "v3"
    shutil.copytree(moe_models["deepseek_v3"], model)
    save_file({"model.layers.3.eh_proj.weight": torch.zeros(64, 128),
               "model.layers.3.self_attn.kv_b_proj.weight": torch.zeros(128, 32)}, model / "mtp.safetensors")
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prompts = [[5, 17, 33, 90, 120]]
    with_mtp = LLM(str(model), num_kv_blocks=16).generate(prompts, params, use_tqdm=False)
    plain = LLM(str(moe_models["deepseek_v3"]), num_kv_blocks=16).generate(prompts, params, use_tqdm=False)
    assert with_mtp[0].token_ids == plain[0].token_ids


def test_absent_deepseek_config_keys_take_transformers_defaults(moe_models: dict[str, Path]) -> None:
    cfg = json.loads((moe_models["deepseek_v3"] / "config.json").read_text())
    for key in ("routed_scaling_factor", "n_group", "topk_group", "q_lora_rank", "first_k_dense_replace"):
        del cfg[key]
    model = ModelConfig.from_dict(cfg)
    assert model.moe is not None and model.mla is not None
    assert (model.moe.routed_scaling_factor, model.moe.n_group, model.moe.topk_group) == (2.5, 8, 4)
    assert model.mla.q_lora_rank == 1536 and model.moe.sparse_layers == ()  # 3 dense layers of 3
    v2 = json.loads((moe_models["deepseek_v2"] / "config.json").read_text())
    del v2["num_experts_per_tok"]
    with pytest.raises(ValueError, match="num_experts_per_tok is required for DeepseekV2ForCausalLM"):
        ModelConfig.from_dict(v2)
