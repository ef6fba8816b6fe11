"""Load a Hugging Face model directory (config.json + safetensors) into the engine model."""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import safe_open

from engine.attention.backend import AttentionBackend
from engine.model.config import ModelConfig
from engine.model.llama import LlamaForCausalLM

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# checkpoint name suffix -> (our parameter suffix, shard index within the fused tensor)
_FUSED = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
}
_IGNORED = re.compile(r"rotary_emb\.inv_freq$")


def safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [model_dir / n for n in names]
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {str(model_dir)!r}")
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise FileNotFoundError(f"safetensors shards listed in the index are missing: {missing}")
    return files


def _shard_sizes(param: str, cfg: ModelConfig) -> list[int]:
    """Row sizes of the checkpoint tensors fused into `param` ([1 row block] if unfused)."""
    if ".qkv_proj." in param:
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        return [q, kv, kv]
    if ".gate_up_proj." in param:
        return [cfg.intermediate_size] * 2
    return [-1]


def _target(name: str, cfg: ModelConfig) -> tuple[str, int]:
    """Map a checkpoint tensor name to (our parameter name, shard index in a fused tensor)."""
    name = name.removeprefix("model.")
    for ckpt, (ours, shard) in _FUSED.items():
        if f".{ckpt}." in name:
            return name.replace(ckpt, ours), shard
    return name, 0


def load_model(model_dir: str | Path, cfg: ModelConfig, dtype: str, device: str,
               backend: AttentionBackend, max_positions: int) -> LlamaForCausalLM:
    """Build the model for `cfg` and fill every parameter from the directory's safetensors."""
    path = Path(model_dir)
    files = safetensors_files(path)
    torch_dtype = TORCH_DTYPES[dtype]
    # Build without initialising weights: every parameter is overwritten from the checkpoint.
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg, backend, max_positions, device)
    model.to_empty(device=device)
    model.to(torch_dtype)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight  # to_empty() unties shared parameters
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded: dict[str, set[int]] = {name: set() for name in params}
    for file in files:
        with safe_open(file, framework="pt", device="cpu") as f:
            for name in f.keys():
                if _IGNORED.search(name):
                    continue
                ours, shard = _target(name, cfg)
                if ours not in params:
                    raise ValueError(f"unexpected tensor {name!r} in {file.name}: not part of a "
                                     f"{cfg.architecture} with this config")
                dest = params[ours].data
                sizes = _shard_sizes(ours, cfg)
                if sizes != [-1]:
                    start = sum(sizes[:shard])
                    dest = dest[start:start + sizes[shard]]
                tensor = f.get_tensor(name)
                if dest.shape != tensor.shape:
                    raise ValueError(f"tensor {name!r} has shape {tuple(tensor.shape)}, "
                                     f"expected {tuple(dest.shape)} from config.json")
                dest.copy_(tensor)
                loaded[ours].add(shard)
    if cfg.tie_word_embeddings:
        loaded["lm_head.weight"] = loaded["embed_tokens.weight"]
    missing = sorted(n for n, shards in loaded.items() if len(shards) < len(_shard_sizes(n, cfg)))
    if missing:
        raise ValueError(f"checkpoint in {str(path)!r} is missing tensors for: {missing[:8]}"
                         f"{' ...' if len(missing) > 8 else ''}")
    model.eval()
    return model
