"""The model facts the engine needs, read from a Hugging Face config.json."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.config import EngineConfig

# Architecture name -> feature flags of the one Llama-family implementation.
SUPPORTED_ARCHITECTURES: dict[str, dict[str, bool]] = {
    "LlamaForCausalLM": {"qk_norm": False},
    "MistralForCausalLM": {"qk_norm": False},
    "Qwen2ForCausalLM": {"qk_norm": False},
    "Qwen3ForCausalLM": {"qk_norm": True},
    "MixtralForCausalLM": {"qk_norm": False},
    "Qwen2MoeForCausalLM": {"qk_norm": False},
    "Qwen3MoeForCausalLM": {"qk_norm": True},
}


@dataclass(frozen=True)
class MoEConfig:
    """The sparse MLP of a mixture-of-experts model (engine/model/moe.py)."""
    num_experts: int
    top_k: int  # experts per token
    intermediate_size: int  # each expert's
    norm_topk_prob: bool  # the top-k routing weights renormalised to sum to 1
    shared_intermediate_size: int  # an always-on shared expert with a sigmoid gate (Qwen2-MoE); 0: none
    sparse_layers: tuple[int, ...]  # the layers whose MLP is sparse (the others dense)

    @classmethod
    def from_dict(cls, arch: str, cfg: dict[str, Any]) -> MoEConfig | None:
        if arch == "MixtralForCausalLM":  # every layer sparse, its experts intermediate_size wide
            return cls(cfg["num_local_experts"], cfg["num_experts_per_tok"], cfg["intermediate_size"], True, 0,
                       tuple(range(cfg["num_hidden_layers"])))
        if arch not in ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"):
            return None
        # The Hub's configs say num_experts; transformers 5 writes num_local_experts for Qwen3-MoE.
        experts = cfg.get("num_experts") or cfg.get("num_local_experts") or 0
        step = cfg.get("decoder_sparse_step", 1)
        dense = set(cfg.get("mlp_only_layers") or [])
        sparse = tuple(i for i in range(cfg["num_hidden_layers"])
                       if i not in dense and experts > 0 and (i + 1) % step == 0)
        shared = cfg.get("shared_expert_intermediate_size", 0) if arch == "Qwen2MoeForCausalLM" else 0
        return cls(experts, cfg["num_experts_per_tok"], cfg["moe_intermediate_size"],
                   bool(cfg.get("norm_topk_prob", False)), shared or 0, sparse)


@dataclass
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_proj_bias: bool
    qk_norm: bool
    hidden_act: str = "silu"
    sliding_window: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    moe: MoEConfig | None = None  # a mixture of experts: its sparse MLP

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir)
        if not path.is_dir():
            raise FileNotFoundError(f"model directory {str(path)!r} does not exist")
        config_file = path / "config.json"
        if not config_file.is_file():
            raise FileNotFoundError(f"{str(path)!r} has no config.json: not a Hugging Face model directory")
        cfg = json.loads(config_file.read_text())
        config = cls.from_dict(cfg)
        gen_file = path / "generation_config.json"
        eos = cfg.get("eos_token_id")
        if gen_file.is_file():
            eos = json.loads(gen_file.read_text()).get("eos_token_id", eos)
        config.eos_token_ids = [eos] if isinstance(eos, int) else list(eos or [])
        return config

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> ModelConfig:
        archs = cfg.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ValueError(f"unsupported model architecture {archs or cfg.get('model_type')!r}; "
                             f"pdserve supports {sorted(SUPPORTED_ARCHITECTURES)}")
        act = cfg.get("hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise ValueError(f"unsupported hidden_act {act!r} (only silu)")
        num_heads = cfg["num_attention_heads"]
        # transformers 5 moved rope_theta/rope_scaling into rope_parameters.
        rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        rope_theta = float(rope.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", "linear", "llama3"):
            raise ValueError(f"unsupported rope_type {rope_type!r} (default, linear, llama3)")
        sliding = cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // num_heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            rope_scaling=None if rope_type == "default" else {**rope, "rope_type": rope_type},
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            # Qwen2 hard-codes q/k/v biases and none on o_proj (Qwen2-MoE: its config's
            # qkv_bias, default on); Llama and Qwen3 use attention_bias for all four projections.
            qkv_bias=(arch == "Qwen2ForCausalLM" or (arch == "Qwen2MoeForCausalLM" and cfg.get("qkv_bias", True))
                      or bool(cfg.get("attention_bias", False))),
            o_proj_bias=(arch not in ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM")
                         and bool(cfg.get("attention_bias", False))),
            qk_norm=SUPPORTED_ARCHITECTURES[arch]["qk_norm"],
            hidden_act=act,
            sliding_window=sliding,
            moe=MoEConfig.from_dict(arch, cfg),
        )

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * dtype_bytes


def max_model_len(config: EngineConfig, mc: ModelConfig) -> int:
    """The context length an engine with this config serves (the launcher tells the
    router, router/config.py ModelLimits)."""
    limit = mc.max_position_embeddings
    # No sliding-window attention: stay within the window, where it equals full attention.
    if mc.sliding_window:
        limit = min(limit, mc.sliding_window)
    if config.max_model_len is not None:
        if config.max_model_len > limit:
            raise ValueError(f"max_model_len {config.max_model_len} exceeds the model's "
                             f"supported context {limit}")
        limit = config.max_model_len
    return limit
