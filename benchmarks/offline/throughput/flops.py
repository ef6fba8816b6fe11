"""The workload's useful FLOPs, from the model's config.json: what the compute floor
divides by the measured matmul rate."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def read_model_config(model_dir: str) -> dict[str, Any]:
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    hidden = cfg["hidden_size"]
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or hidden // heads
    return {
        "architecture": (cfg.get("architectures") or ["?"])[0],
        "vocab_size": cfg["vocab_size"],
        "hidden_size": hidden,
        "intermediate_size": cfg["intermediate_size"],
        "num_layers": cfg["num_hidden_layers"],
        "num_heads": heads,
        "num_kv_heads": cfg.get("num_key_value_heads", heads),
        "head_dim": head_dim,
        "tie_word_embeddings": bool(cfg.get("tie_word_embeddings", False)),
    }


def non_embedding_linear_params(mc: dict[str, Any]) -> int:
    """Weights of the per-layer matmuls (q, k, v, o, gate, up, down); norms are negligible."""
    h, i = mc["hidden_size"], mc["intermediate_size"]
    q = mc["num_heads"] * mc["head_dim"]
    kv = mc["num_kv_heads"] * mc["head_dim"]
    per_layer = h * q + 2 * h * kv + q * h + 3 * h * i
    return per_layer * mc["num_layers"]


def workload_flops(mc: dict[str, Any], prompt_lens: list[int], output_lens: list[int]) -> dict[str, float]:
    n_params = non_embedding_linear_params(mc)
    attn_width = mc["num_heads"] * mc["head_dim"]
    dense = attn = lm_head = 0
    for p, o in zip(prompt_lens, output_lens):
        t = p + o - 1  # tokens that go through the model (the last sampled one never does)
        dense += 2 * n_params * t
        attn += 4 * mc["num_layers"] * attn_width * (t * (t + 1) // 2)  # ctx = 1..t
        lm_head += 2 * mc["hidden_size"] * mc["vocab_size"] * o
    return {"non_embedding_linear_params": n_params, "dense": float(dense),
            "attention": float(attn), "lm_head": float(lm_head),
            "total": float(dense + attn + lm_head)}
