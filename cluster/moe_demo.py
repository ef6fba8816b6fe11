"""The MoE demo: a DeepSeek-V3-shaped model (multi-head latent attention, 8 routed
experts in 4 groups plus a shared one, the first layer dense) small enough for a CPU,
with the dense demo's tokenizer and generated weights (load_format: dummy).

Nothing is downloaded beyond the dense demo's tokenizer, and no weights are written:
the directory holds config.json and the tokenizer, and every worker draws the same
weights from the seed (engine/model/dummy_weights.py). The text it writes is
meaningless; what it shows is the serving path of the models P/D is deployed for: a
latent KV cache pushed between workers, experts split over a decode worker's ranks
(configs/local-moe.yaml). `pdserve model prepare deepseek-mini` builds it.
"""

from __future__ import annotations

import json
import pathlib
import shutil
from typing import Any

NAME = "deepseek-mini"
DIR_NAME = "DeepSeek-V3-mini-dummy"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")


def mini_config(vocab_size: int, bos: int | None, eos: int | list[int] | None) -> dict[str, Any]:
    """Heads, experts and widths that split over 2 ranks (expert parallel: 4 experts each)."""
    return {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
        "vocab_size": vocab_size, "hidden_size": 512, "intermediate_size": 1024, "num_hidden_layers": 6,
        "num_attention_heads": 8, "num_key_value_heads": 8, "q_lora_rank": 256, "kv_lora_rank": 128,
        "qk_nope_head_dim": 64, "qk_rope_head_dim": 32, "v_head_dim": 64,
        "n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 256, "n_shared_experts": 1,
        "n_group": 4, "topk_group": 2, "first_k_dense_replace": 1, "routed_scaling_factor": 2.5,
        "norm_topk_prob": True, "rope_interleave": True, "hidden_act": "silu", "rms_norm_eps": 1e-6,
        "max_position_embeddings": 4096, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "tie_word_embeddings": False, "bos_token_id": bos, "eos_token_id": eos, "dtype": "float32",
    }


def prepare_moe_demo(models_dir: pathlib.Path, force: bool = False) -> pathlib.Path:
    """models_dir/DIR_NAME: config.json plus the dense demo's tokenizer (built first if
    missing). Idempotent unless force."""
    from cluster.demo_model import prepare_demo_model

    target = models_dir / DIR_NAME
    if not force and (target / "config.json").is_file() and (target / "tokenizer.json").is_file():
        return target
    dense = prepare_demo_model("smollm2", models_dir)
    dense_cfg = json.loads((dense / "config.json").read_text())
    target.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        if (dense / name).is_file():
            shutil.copyfile(dense / name, target / name)
    config = mini_config(dense_cfg["vocab_size"], dense_cfg.get("bos_token_id"), dense_cfg.get("eos_token_id"))
    (target / "config.json").write_text(json.dumps(config, indent=2) + "\n")  # last: it marks the dir complete
    return target
