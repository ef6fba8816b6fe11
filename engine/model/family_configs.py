"""The parts of a ModelConfig (model/config.py) that only some families have, each read
from a Hugging Face config.json: a mixture of experts' sparse MLP (MoEConfig), DeepSeek's
latent attention (MLAConfig), and Gemma 2/3's departures (GemmaConfig)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

GEMMA = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
DEEPSEEK = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")


@dataclass(frozen=True)
class MoEConfig:
    """The sparse MLP of a mixture-of-experts model (engine/model/moe.py)."""
    num_experts: int
    top_k: int  # experts per token
    intermediate_size: int  # each expert's
    norm_topk_prob: bool  # the top-k routing weights renormalised to sum to 1
    shared_intermediate_size: int  # an always-on shared expert (0: none)
    sparse_layers: tuple[int, ...]  # the layers whose MLP is sparse (the others dense)
    shared_gate: bool = False  # the shared expert scaled by a sigmoid gate (Qwen2-MoE)
    # DeepSeek's routing: "softmax" or "sigmoid" scores (V3, with a learned correction
    # bias that picks the experts but does not weigh them); "greedy" top-k, or top-k
    # within the topk_group best of n_group expert groups (a group's score: its best
    # expert's, or with sigmoid scoring its best two summed); the weights times
    # routed_scaling_factor.
    scoring: str = "softmax"
    grouped: bool = False
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0

    @classmethod
    def from_dict(cls, arch: str, cfg: dict[str, Any]) -> MoEConfig | None:
        layers = cfg["num_hidden_layers"]
        if arch == "MixtralForCausalLM":  # every layer sparse, its experts intermediate_size wide
            return cls(cfg["num_local_experts"], cfg["num_experts_per_tok"], cfg["intermediate_size"], True, 0,
                       tuple(range(layers)))
        if arch in DEEPSEEK:
            return cls._deepseek(arch, cfg)
        if arch not in ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"):
            return None
        # The Hub's configs say num_experts; transformers 5 writes num_local_experts for Qwen3-MoE.
        experts = cfg.get("num_experts") or cfg.get("num_local_experts") or 0
        step = cfg.get("decoder_sparse_step", 1)
        dense = set(cfg.get("mlp_only_layers") or [])
        sparse = tuple(i for i in range(layers) if i not in dense and experts > 0 and (i + 1) % step == 0)
        shared = cfg.get("shared_expert_intermediate_size", 0) if arch == "Qwen2MoeForCausalLM" else 0
        return cls(experts, cfg["num_experts_per_tok"], cfg["moe_intermediate_size"],
                   bool(cfg.get("norm_topk_prob", False)), shared or 0, sparse, shared_gate=bool(shared))

    @classmethod
    def _deepseek(cls, arch: str, cfg: dict[str, Any]) -> MoEConfig | None:
        experts = cfg.get("n_routed_experts", 256 if arch == "DeepseekV3ForCausalLM" else 64) or 0
        if not experts:
            return None
        v3 = arch == "DeepseekV3ForCausalLM"
        method = "noaux_tc" if v3 else cfg.get("topk_method", "greedy")
        if method not in ("greedy", "group_limited_greedy", "noaux_tc"):
            raise ValueError(f"unsupported topk_method {method!r} (greedy, group_limited_greedy; "
                             "DeepSeek-V3 routes noaux_tc)")
        grouped = method != "greedy"
        # Absent keys take transformers' defaults for the architecture.
        n_group, topk_group = (cfg.get("n_group", 8 if v3 else None), cfg.get("topk_group", 4 if v3 else None))
        if grouped and (not n_group or not topk_group or experts % n_group or not 0 < topk_group <= n_group):
            raise ValueError(f"{method} routing: n_group {n_group} must divide n_routed_experts {experts} "
                             f"and topk_group {topk_group} be in [1, n_group]")
        inter = cfg["moe_intermediate_size"]
        first_dense = cfg.get("first_k_dense_replace", 3 if v3 else 0) or 0
        # transformers' DeepSeek-V2 never renormalises the top-k weights; V3 does by its config.
        top_k = cfg.get("num_experts_per_tok", 8 if v3 else None)
        if not top_k:
            raise ValueError(f"num_experts_per_tok is required for {arch} with n_routed_experts {experts}")
        return cls(experts, top_k, inter,
                   v3 and bool(cfg.get("norm_topk_prob", True)), inter * (cfg.get("n_shared_experts", 1 if v3 else 2)
                                                                         or 0),
                   tuple(range(first_dense, cfg["num_hidden_layers"])), scoring="sigmoid" if v3 else "softmax",
                   grouped=grouped, n_group=int(n_group or 1) if grouped else 1,
                   topk_group=int(topk_group or 1) if grouped else 1,
                   routed_scaling_factor=float(cfg.get("routed_scaling_factor", 2.5 if v3 else 1.0)))


@dataclass(frozen=True)
class MLAConfig:
    """DeepSeek's multi-head latent attention (engine/model/mla.py). The KV cache holds
    one vector per token and layer, kv_lora_rank + qk_rope_head_dim wide, shared by
    every head (and so by every tensor-parallel rank)."""
    q_lora_rank: int | None  # None: q projected from the hidden state directly
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool  # the rope dims' checkpoint order is pairs (x0, x1), (x2, x3), ...
    rope_fp32: bool = False  # rotated in float32 and rounded once (transformers' DeepSeek-V2), else in x's dtype

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim

    @classmethod
    def from_dict(cls, arch: str, cfg: dict[str, Any]) -> MLAConfig | None:
        if arch not in DEEPSEEK:
            return None
        return cls(cfg.get("q_lora_rank", 1536), cfg.get("kv_lora_rank", 512), cfg.get("qk_nope_head_dim", 128),
                   cfg.get("qk_rope_head_dim", 64), cfg.get("v_head_dim", 128),
                   # transformers' DeepSeek-V2 always rotates interleaved pairs; V3 as its config says.
                   arch == "DeepseekV2ForCausalLM" or bool(cfg.get("rope_interleave", True)),
                   rope_fp32=arch == "DeepseekV2ForCausalLM")


@dataclass(frozen=True)
class GemmaConfig:
    """Gemma 2/3 beyond their norm placement (engine/model/gemma.py): RMSNorms scale by
    (1 + weight), embeddings are multiplied by sqrt(hidden_size), the MLP is GeGLU
    (tanh-approximated GELU), queries are scaled by query_pre_attn_scalar ** -0.5, and
    scores (Gemma 2) and final logits may be soft-capped."""
    query_scale: float
    attn_softcap: float  # 0: none
    final_softcap: float  # 0: none
    # Gemma 3: its sliding layers' RoPE base (default RoPE; the global layers take the
    # model's rope_theta and scaling); None: one RoPE for every layer (Gemma 2).
    local_rope_theta: float | None
    local_layers: tuple[int, ...] = ()  # Gemma 3: the layers that turn by local_rope_theta

    @classmethod
    def from_dict(cls, arch: str, cfg: dict[str, Any]) -> GemmaConfig | None:
        if arch not in GEMMA:
            return None
        local, local_layers = None, tuple[int, ...]()
        if arch == "Gemma3ForCausalLM":
            rope = cfg.get("rope_parameters") or {}
            params = rope.get("sliding_attention") or {} if isinstance(rope, dict) else {}
            if params.get("rope_type", "default") != "default":
                raise ValueError(f"unsupported rope_type {params['rope_type']!r} for Gemma 3's sliding layers "
                                 "(default only)")
            local = float(params.get("rope_theta", cfg.get("rope_local_base_freq", 10000.0)))
            # As transformers picks the RoPE: by layer type (sliding ones local), whether
            # or not a window is set.
            local_layers = tuple(i for i, t in enumerate(layer_types(arch, cfg) or ()) if t == "sliding_attention")
        # Gemma 2's defaults cap both (transformers' Gemma2Config); Gemma 3's neither.
        gemma2 = arch == "Gemma2ForCausalLM"
        caps = [cfg.get("attn_logit_softcapping", 50.0 if gemma2 else None),
                cfg.get("final_logit_softcapping", 30.0 if gemma2 else None)]
        if any(c is not None and not (isinstance(c, (int, float)) and c > 0) for c in caps):
            raise ValueError(f"attn_logit_softcapping and final_logit_softcapping must be positive or null, "
                             f"got {caps}")
        return cls(float(cfg.get("query_pre_attn_scalar", 256)) ** -0.5, float(caps[0] or 0.0),
                   float(caps[1] or 0.0), local, local_layers)


# Where transformers' model reads sliding_window, and its default when the config has
# none (the others, Llama, OLMo 2, DeepSeek, attend over every position whatever the
# config says). The Qwen ones only with use_sliding_window, off unless set.
_WINDOW_DEFAULTS: dict[str, int | None] = {
    "MistralForCausalLM": None, "MixtralForCausalLM": None, "Phi3ForCausalLM": None,
    "Qwen2ForCausalLM": None, "Qwen3ForCausalLM": None, "Qwen2MoeForCausalLM": None, "Qwen3MoeForCausalLM": None,
    "Gemma2ForCausalLM": 4096, "Gemma3ForCausalLM": 4096,
}
_QWEN = ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")
# These window every layer alike, whatever a layer_types key says.
_EVERY_LAYER = ("MistralForCausalLM", "MixtralForCausalLM", "Phi3ForCausalLM", "Qwen3MoeForCausalLM")


def sliding_window(arch: str, cfg: dict[str, Any]) -> Any:
    """The window the architecture's layers that slide attend over, as transformers
    reads the config (None: no layer slides). Checked by the caller."""
    if arch not in _WINDOW_DEFAULTS or (arch in _QWEN and not cfg.get("use_sliding_window", False)):
        return None
    return cfg.get("sliding_window", _WINDOW_DEFAULTS[arch])


def layer_types(arch: str, cfg: dict[str, Any]) -> list[str] | None:
    """Each layer's kind, "sliding_attention" or "full_attention": the config's
    layer_types, or where it has none transformers' default for the architecture (Gemma
    2 alternates; Gemma 3 has 5 sliding layers, its sliding_window_pattern - 1, before
    each full one; Qwen2 and Qwen3 slide from layer max_window_layers on; Qwen2-MoE on
    the even layers below it). None: every layer alike (Mistral, Phi-3, Mixtral,
    Qwen3-MoE: windowed when the config has a window)."""
    types = cfg.get("layer_types")
    if arch in _EVERY_LAYER:
        return None
    if types:
        return list(types)
    n = cfg["num_hidden_layers"]
    if arch in GEMMA:
        pattern = 2 if arch == "Gemma2ForCausalLM" else (cfg.get("sliding_window_pattern")
                                                           or cfg.get("_sliding_window_pattern") or 6)
        return ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(n)]
    last_full = cfg.get("max_window_layers", 28)
    if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        return ["sliding_attention" if i >= last_full else "full_attention" for i in range(n)]
    if arch == "Qwen2MoeForCausalLM":
        return ["sliding_attention" if (i + 1) % 2 and i < last_full else "full_attention" for i in range(n)]
    return None
