"""Model directories: clear errors for what pdserve cannot load, dtypes for what it can."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import LLM, SamplingParams
from engine.model.config import ModelConfig


def copy_model(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def edit_config(model_dir: Path, **changes) -> None:
    path = model_dir / "config.json"
    cfg = json.loads(path.read_text())
    cfg.update(changes)
    path.write_text(json.dumps(cfg))


def test_unsupported_architecture_is_named(llama_dir: Path, tmp_path: Path) -> None:
    d = copy_model(llama_dir, tmp_path / "m")
    edit_config(d, architectures=["GPT2LMHeadModel"])
    with pytest.raises(ValueError, match="unsupported model architecture.*GPT2LMHeadModel"):
        LLM(str(d))


def test_missing_directory_and_files(llama_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        LLM(str(tmp_path / "nope"))
    d = copy_model(llama_dir, tmp_path / "m")
    (d / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        LLM(str(d))
    (d / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="no config.json"):
        LLM(str(d))


def test_missing_tensor_is_named(llama_dir: Path, tmp_path: Path) -> None:
    d = copy_model(llama_dir, tmp_path / "m")
    tensors = load_file(d / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, d / "model.safetensors")
    with pytest.raises(ValueError, match="missing tensors.*layers.1.mlp.gate_up_proj"):
        LLM(str(d))


def test_sharded_checkpoint_loads_identically(llama_dir: Path, tmp_path: Path) -> None:
    d = copy_model(llama_dir, tmp_path / "m")
    tensors = load_file(d / "model.safetensors")
    names = sorted(tensors)
    half = len(names) // 2
    shards = {"model-00001-of-00002.safetensors": names[:half], "model-00002-of-00002.safetensors": names[half:]}
    for file, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, d / file)
    (d / "model.safetensors").unlink()
    index = {"weight_map": {k: f for f, keys in shards.items() for k in keys}}
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompt = [[5, 6, 7, 8, 9]]
    assert (LLM(str(d)).generate(prompt, params, use_tqdm=False)[0].token_ids
            == LLM(str(llama_dir)).generate(prompt, params, use_tqdm=False)[0].token_ids)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_runs_and_mostly_agrees(llama_dir: Path, dtype: str) -> None:
    llm = LLM(str(llama_dir), dtype=dtype)
    assert llm.core.kv_cache.dtype == getattr(torch, dtype)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompts = [[5, 6, 7, 8, 9], list(range(20, 60))]
    half = llm.generate(prompts, params, use_tqdm=False)
    full = LLM(str(llama_dir)).generate(prompts, params, use_tqdm=False)
    # Rounding may flip a near-tie late in a sequence, never the first tokens of both.
    assert any(h.token_ids[:2] == f.token_ids[:2] for h, f in zip(half, full))


def test_config_fields_for_each_family(tiny_models: dict[str, Path]) -> None:
    llama = ModelConfig.from_model_dir(tiny_models["llama"])
    qwen2 = ModelConfig.from_model_dir(tiny_models["qwen2"])
    qwen3 = ModelConfig.from_model_dir(tiny_models["qwen3"])
    assert llama.rope_scaling["rope_type"] == "llama3" and llama.tie_word_embeddings
    assert qwen2.qkv_bias and not qwen2.o_proj_bias and not qwen2.qk_norm
    assert qwen3.qk_norm and qwen3.head_dim == 32 and not qwen3.tie_word_embeddings
    assert llama.eos_token_ids == [1]
    olmo2 = ModelConfig.from_model_dir(tiny_models["olmo2"])
    phi3 = ModelConfig.from_model_dir(tiny_models["phi3"])
    assert olmo2.qk_norm == "projection" and olmo2.norm_placement == "post" and qwen3.qk_norm == "head"
    assert phi3.partial_rotary_factor == 0.5 and phi3.rotary_dim == 8 and phi3.sliding_window == 28
    assert llama.norm_placement == phi3.norm_placement == "pre" and llama.rotary_dim == llama.head_dim


def test_unsupported_rope_type_is_named() -> None:
    cfg = {"architectures": ["LlamaForCausalLM"], "vocab_size": 10, "hidden_size": 8,
           "intermediate_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
           "rope_scaling": {"rope_type": "dynamic", "factor": 4.0}}
    with pytest.raises(ValueError, match="unsupported rope_type 'dynamic'"):
        ModelConfig.from_dict(cfg)
    yarn = {**cfg, "max_position_embeddings": 4096, "rope_scaling": {"rope_type": "yarn", "factor": None}}
    with pytest.raises(ValueError, match="yarn rope scaling needs a numeric factor, got None"):
        ModelConfig.from_dict(yarn)
    yarn["rope_scaling"]["factor"] = 4.0  # original_max_position_embeddings: the config's context, as transformers
    assert ModelConfig.from_dict(yarn).rope_scaling["original_max_position_embeddings"] == 4096


def test_phi3_longrope_is_read_and_bad_partial_rotary_is_named() -> None:
    cfg = {"architectures": ["Phi3ForCausalLM"], "vocab_size": 10, "hidden_size": 64, "intermediate_size": 16,
           "num_hidden_layers": 1, "num_attention_heads": 4, "max_position_embeddings": 131072}
    factors = {"short_factor": [1.0] * 8, "long_factor": [2.0] * 8, "original_max_position_embeddings": 4096}
    # Phi-3-mini-128k's rope_scaling; "su" is its older name, which transformers reads as longrope.
    for rope in ({"type": "longrope", **factors}, {"type": "su", **factors},
                 {"rope_type": "longrope", "rope_theta": 10000.0, **factors}):
        assert ModelConfig.from_dict({**cfg, "rope_scaling": rope}).rope_scaling["rope_type"] == "longrope"
    for bad in (0.3125, 1.5, 0):  # 5 of each head's 16 dims; more than all; none
        with pytest.raises(ValueError, match="partial_rotary_factor must be in .0, 1. and turn an even number"):
            ModelConfig.from_dict({**cfg, "partial_rotary_factor": bad})
    assert ModelConfig.from_dict({**cfg, "partial_rotary_factor": 0.75}).rotary_dim == 12  # Phi-4-mini's key
    llama = {**cfg, "architectures": ["LlamaForCausalLM"], "partial_rotary_factor": 0.5}
    assert ModelConfig.from_dict(llama).rotary_dim == 16  # transformers' Llama turns every dim


@pytest.mark.timeout(120)
def test_building_a_model_imports_neither_dynamo_nor_sympy(llama_dir: Path) -> None:
    """Each process that builds a model (a worker, a TP follower) would pay 1.5-2 CPU-s
    importing them, and none uses them: nn.Embedding's normal_ init and to_empty()'s
    empty_like under the meta device did (engine/model/llama.py `embedding`)."""
    code = ("import sys; from engine import LLM, SamplingParams; "
            "llm = LLM(sys.argv[1], tensor_parallel_size=2, num_threads=1, num_kv_blocks=64); "
            "llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2), use_tqdm=False); "
            "print(sorted(m for m in ('torch._dynamo', 'sympy') if m in sys.modules))")
    repo = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", code, str(llama_dir)], cwd=repo, capture_output=True, text=True,
                         env=dict(os.environ, PYTHONPATH=str(repo)), timeout=100)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout
