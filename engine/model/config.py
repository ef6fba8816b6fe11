"""The model facts the engine needs, read from a Hugging Face config.json."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine.model.family_configs import (
    DEEPSEEK,
    GEMMA,
    GemmaConfig,
    MLAConfig,
    MoEConfig,
    layer_types,
    sliding_window,
)

if TYPE_CHECKING:
    from engine.config import EngineConfig

__all__ = ["DEEPSEEK", "GEMMA", "Features", "GemmaConfig", "MLAConfig", "ModelConfig", "MoEConfig", "layer_types",
           "SUPPORTED_ARCHITECTURES", "checkpoint_quantization", "max_model_len", "release_window"]


@dataclass(frozen=True)
class Features:
    """Where an architecture departs from Llama in the one Llama-family model."""
    # RMSNorms on q and k before RoPE: None; "head", over each head (Qwen3); "projection",
    # over the whole q and the whole k projection, every head at once (OLMo 2: model/olmo2.py).
    qk_norm: str | None = None
    # "pre": a norm before each sublayer (Llama); "post": no input norm, each sublayer's
    # output normalised before its residual add (OLMo 2); "sandwich": both (Gemma 2/3).
    norm_placement: str = "pre"


# Architecture name -> its features in the one Llama-family implementation.
SUPPORTED_ARCHITECTURES: dict[str, Features] = {
    "LlamaForCausalLM": Features(),
    "MistralForCausalLM": Features(),
    "Qwen2ForCausalLM": Features(),
    "Qwen3ForCausalLM": Features(qk_norm="head"),
    "MixtralForCausalLM": Features(),
    "Qwen2MoeForCausalLM": Features(),
    "Qwen3MoeForCausalLM": Features(qk_norm="head"),
    "DeepseekV2ForCausalLM": Features(),
    "DeepseekV3ForCausalLM": Features(),
    "Olmo2ForCausalLM": Features(qk_norm="projection", norm_placement="post"),
    # Fused qkv_proj and gate_up_proj in its checkpoint (the loader reads them as they are).
    "Phi3ForCausalLM": Features(),
    # Their other departures: GemmaConfig.
    "Gemma2ForCausalLM": Features(norm_placement="sandwich"),
    "Gemma3ForCausalLM": Features(qk_norm="head", norm_placement="sandwich"),
}


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
    qk_norm: str | None  # Features.qk_norm
    hidden_act: str = "silu"
    norm_placement: str = "pre"  # Features.norm_placement
    # RoPE turns the first int(head_dim * partial_rotary_factor) dims of each head; the
    # rest pass through (Phi-3's rope_parameters; 1.0 elsewhere).
    partial_rotary_factor: float = 1.0
    sliding_window: int | None = None  # the window of the layers that have one
    # Per layer, its sliding window (0: full attention); () when no layer has one.
    layer_windows: tuple[int, ...] = ()
    eos_token_ids: list[int] = field(default_factory=list)
    moe: MoEConfig | None = None  # a mixture of experts: its sparse MLP
    # Multi-head latent attention: the cache holds one latent "KV head" of
    # mla.latent_dim per token and layer (num_kv_heads 1, head_dim latent_dim, one plane).
    mla: MLAConfig | None = None
    gemma: GemmaConfig | None = None
    # "fp8": the checkpoint's decoder linears are float8 with per-tensor or per-channel
    # weight scales (engine/model/fp8_linear.py); None: unquantized.
    quantization: str | None = None

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
        gemma = GemmaConfig.from_dict(arch, cfg)
        if gemma is not None:  # Gemma names it hidden_activation
            act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
            if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
                raise ValueError(f"unsupported hidden_activation {act!r} for {arch} (gelu_pytorch_tanh only)")
        else:
            act = cfg.get("hidden_act", "silu")
            if act not in ("silu", "swish"):
                raise ValueError(f"unsupported hidden_act {act!r} (only silu)")
        num_heads = cfg["num_attention_heads"]
        rope = cfg.get("rope_parameters")
        if arch == "Gemma3ForCausalLM":
            if isinstance(rope, dict) and "full_attention" in rope:
                cfg = {**cfg, "rope_parameters": rope["full_attention"]}  # per layer kind; the local: GemmaConfig
            else:  # an older config: rope_theta (its default 1e6) is the global layers'
                cfg = {"rope_theta": 1_000_000.0, **cfg}
        rope_theta, rope_scaling, partial = _rope(arch, cfg)
        sliding = sliding_window(arch, cfg)
        mla = MLAConfig.from_dict(arch, cfg)
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=1 if mla else cfg.get("num_key_value_heads") or num_heads,
            head_dim=mla.latent_dim if mla else _head_dim(cfg),
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=cfg.get("tie_word_embeddings", gemma is not None),  # Gemma ties by default
            # Qwen2 hard-codes q/k/v biases and none on o_proj (Qwen2-MoE: its config's
            # qkv_bias, default on); Llama and Qwen3 use attention_bias for all four projections.
            qkv_bias=(arch == "Qwen2ForCausalLM" or (arch == "Qwen2MoeForCausalLM" and cfg.get("qkv_bias", True))
                      or bool(cfg.get("attention_bias", False))),
            o_proj_bias=(arch not in ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM")
                         and bool(cfg.get("attention_bias", False))),
            qk_norm=SUPPORTED_ARCHITECTURES[arch].qk_norm,
            hidden_act=act,
            norm_placement=SUPPORTED_ARCHITECTURES[arch].norm_placement,
            partial_rotary_factor=partial,
            sliding_window=sliding,
            layer_windows=_layer_windows(layer_types(arch, cfg), sliding, cfg["num_hidden_layers"]),
            moe=MoEConfig.from_dict(arch, cfg),
            mla=mla,
            gemma=gemma,
            quantization=checkpoint_quantization(cfg.get("quantization_config")),
        )

    def layer_window(self, layer: int) -> int:
        """The layer's sliding window: it attends over its last that many positions (0: all)."""
        return self.layer_windows[layer] if self.layer_windows else 0

    @property
    def uniform_window(self) -> int:
        """The widest window when every layer has one (0 when any attends over all
        positions): then no layer reads a block wholly before a token's widest window."""
        return max(self.layer_windows) if self.layer_windows and all(self.layer_windows) else 0

    @property
    def rotary_dim(self) -> int:
        """The dims of each head RoPE turns (the first ones), as transformers rounds them."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def kv_planes(self) -> int:
        """Vectors per token, layer and KV head in the cache: K and V, or MLA's one latent."""
        return 1 if self.mla else 2

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return self.num_layers * self.kv_planes * self.num_kv_heads * self.head_dim * dtype_bytes


def _rope(arch: str, cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None, float]:
    """(rope_theta, the scaling dict or None for default RoPE, partial_rotary_factor),
    refusing by name what pdserve does not compute."""
    # transformers 5 moved rope_theta/rope_scaling into rope_parameters.
    rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    rope_theta = float(rope.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
    partial = _partial_rotary(arch, cfg, rope.pop("partial_rotary_factor", cfg.get("partial_rotary_factor")))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if arch == "Phi3ForCausalLM" and rope_type != "default":
        # transformers runs Phi-3's "su" and "yarn" types as longrope (Phi3Config).
        if rope_type not in ("longrope", "su", "yarn"):
            raise ValueError(f"unsupported rope_scaling type {rope_type!r} for Phi3ForCausalLM (default, longrope)")
        return rope_theta, _longrope(cfg, rope, int(_head_dim(cfg) * partial)), partial
    if rope_type not in ("default", "linear", "llama3", "yarn"):
        raise ValueError(f"unsupported rope_type {rope_type!r} (default, linear, llama3, yarn)")
    if rope_type == "yarn":
        if not isinstance(rope.get("factor"), (int, float)):
            raise ValueError(f"yarn rope scaling needs a numeric factor, got {rope.get('factor')!r}")
        # transformers' default: the config's context is the one it was trained at
        rope.setdefault("original_max_position_embeddings", cfg.get("max_position_embeddings", 2048))
    scaling = None if rope_type == "default" else {**rope, "rope_type": rope_type}
    return rope_theta, scaling, partial


def _partial_rotary(arch: str, cfg: dict[str, Any], partial: Any) -> float:
    if arch != "Phi3ForCausalLM" or partial is None:
        return 1.0  # only Phi-3's transformers model turns part of a head
    head_dim = _head_dim(cfg)
    if not isinstance(partial, (int, float)) or not 0 < partial <= 1 or int(head_dim * partial) % 2:
        raise ValueError(f"partial_rotary_factor must be in (0, 1] and turn an even number of each head's "
                         f"{head_dim} dims, got {partial!r}")
    return float(partial)


def _head_dim(cfg: dict[str, Any]) -> int:
    """An attention head's width, as transformers reads it (an explicit head_dim, else hidden / heads)."""
    return cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _longrope(cfg: dict[str, Any], rope: dict[str, Any], rotary_dim: int) -> dict[str, Any]:
    """Phi-3's longrope scaling, checked (rope.py longrope_factors: which factors an
    engine turns by). Its original_max_position_embeddings is the top-level one, else
    Phi3Config's default, 4096, as transformers reads it (never rope_scaling's)."""
    key = "rope_parameters" if cfg.get("rope_parameters") else "rope_scaling"
    # Phi3Config's: rope_scaling's own is overwritten by it (standardize_rope_params).
    original = cfg.get("original_max_position_embeddings", 4096)
    if isinstance(original, bool) or not isinstance(original, int) or original < 2:  # its log divides
        raise ValueError(f"original_max_position_embeddings must be an integer >= 2, got {original!r}")
    for name in ("short_factor", "long_factor"):
        factors = rope.get(name)
        if (not isinstance(factors, list) or len(factors) != rotary_dim // 2
                or not all(_number(f) and f > 0 for f in factors)):
            got = f"a list of {len(factors)}" if isinstance(factors, list) else repr(factors)
            raise ValueError(f"{key}.{name} must be a list of {rotary_dim // 2} positive numbers (one per pair "
                             f"of the {rotary_dim} rotary dims), got {got}")
    # transformers' default: the ratio of the context to the original one (for attention_factor)
    factor = rope.get("factor")
    if factor is None:
        factor = cfg.get("max_position_embeddings", 4096) / original
    attention = rope.get("attention_factor")
    for name, value in (("factor", factor), ("attention_factor", attention)):
        if value is not None and not (_number(value) and value > 0):
            raise ValueError(f"{key}.{name} must be a positive number, got {value!r}")
    return {**rope, "rope_type": "longrope", "original_max_position_embeddings": original, "factor": factor,
            "attention_factor": attention}


def checkpoint_quantization(qc: Any) -> str | None:
    """"fp8" for a checkpoint of float8 weights with per-tensor or per-channel scales
    (compressed-tensors' float8 kinds, fbgemm_fp8, AutoFP8's fp8); ValueError naming
    any other quantization, which this engine cannot load."""
    if qc is None:
        return None
    method = qc.get("quant_method") if isinstance(qc, dict) else None
    if method == "fbgemm_fp8":
        return "fp8"
    if method == "fp8":
        if qc.get("weight_block_size"):
            raise ValueError(f"fp8 checkpoints with block-wise weight scales (weight_block_size "
                             f"{qc['weight_block_size']}) are not supported yet: per-tensor and per-channel only")
        return "fp8"
    if method == "compressed-tensors":
        groups = qc.get("config_groups") or {}
        weights = [g.get("weights") or {} for g in groups.values() if isinstance(g, dict)]
        kinds = {(w.get("type"), w.get("num_bits"), w.get("strategy")) for w in weights}
        if not weights and qc.get("kv_cache_scheme"):
            return None  # an fp8 KV cache's scales only: the weights are unquantized
        if weights and all(t == "float" and bits == 8 and strategy in ("tensor", "channel")
                           for t, bits, strategy in kinds):
            return "fp8"
        raise ValueError(f"compressed-tensors checkpoint with weights {sorted(map(str, kinds))}: only float8 "
                         "weights with per-tensor or per-channel scales are supported")
    raise ValueError(f"unsupported checkpoint quantization {method!r}: pdserve loads fp8 "
                     "(compressed-tensors float8, fbgemm_fp8, fp8) checkpoints")


def _layer_windows(types: list[str] | None, sliding: int | None, layers: int) -> tuple[int, ...]:
    """Each layer's window: `sliding` on the layers `types` call sliding_attention, or
    on every layer where it lists none (family_configs.layer_types); () for none."""
    if not sliding:
        return ()
    if not isinstance(sliding, int) or sliding < 1:
        raise ValueError(f"sliding_window must be a positive integer or null, got {sliding!r}")
    if types is None:
        return (sliding,) * layers
    kinds = {"sliding_attention": sliding, "full_attention": 0}
    if len(types) != layers or any(t not in kinds for t in types):
        raise ValueError(f"layer_types must list {layers} entries of {sorted(kinds)}, got {types!r}")
    windows = tuple(kinds[t] for t in types)
    return windows if any(windows) else ()


def release_window(*configs: ModelConfig) -> int:
    """The window within which every layer of all these models (a target and its draft,
    reading one block table) attends, or 0 when some layer attends over every position:
    with a window, blocks wholly before a request's window can be released
    (KVCacheManager)."""
    windows = [c.uniform_window for c in configs]
    return 0 if not windows or not all(windows) else max(windows)


def max_model_len(config: EngineConfig, mc: ModelConfig) -> int:
    """The context length an engine with this config serves (the launcher tells the
    router, router/config.py ModelLimits)."""
    limit = mc.max_position_embeddings
    if config.max_model_len is not None:
        if config.max_model_len > limit:
            raise ValueError(f"max_model_len {config.max_model_len} exceeds the model's "
                             f"supported context {limit}")
        limit = config.max_model_len
    return limit
