"""Build tiny random Hugging Face models (seeded) plus a trained tokenizer, offline."""

from __future__ import annotations

from pathlib import Path

import torch

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Paged attention stores keys and values in fixed-size blocks.",
    "Continuous batching mixes prefill and decode tokens in one step.",
    "Prefix caching reuses blocks whose tokens were already computed.",
    "What is the capital of France? The capital of France is Paris.",
    "pdserve serves large language models with disaggregated prefill and decode.",
] * 20

VOCAB_SIZE = 384


def train_tokenizer(out_dir: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    fast.chat_template = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n"
                          "{% endfor %}{% if add_generation_prompt %}<s>assistant:{% endif %}")
    fast.save_pretrained(out_dir)
    return fast


MOE_ARCHS = ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v2", "deepseek_v2_qlora", "deepseek_v3")


def _deepseek_config(arch: str, common: dict):
    """Multi-head latent attention over a 32 + 16 wide latent (v_head_dim 16, unlike
    qk's 16 + 16), 8 routed experts in 4 groups and one shared expert, the first of 3
    layers dense: V2 without a q LoRA and group-limited routing; V2 with one, greedy
    routing and yarn RoPE; V3 (sigmoid scores, correction bias, grouped top-k,
    routed_scaling_factor 2.5)."""
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM, DeepseekV3Config, DeepseekV3ForCausalLM

    ds = dict(common, num_hidden_layers=3, num_key_value_heads=4, kv_lora_rank=32, qk_nope_head_dim=16,
              qk_rope_head_dim=16, v_head_dim=16, n_routed_experts=8, num_experts_per_tok=2,
              moe_intermediate_size=32, n_shared_experts=1, first_k_dense_replace=1, n_group=4, topk_group=2,
              tie_word_embeddings=False)
    if arch == "deepseek_v2":
        return DeepseekV2Config(**ds, q_lora_rank=None, topk_method="group_limited_greedy"), DeepseekV2ForCausalLM
    if arch == "deepseek_v2_qlora":
        yarn = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 256,
                "mscale": 0.707, "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1}
        return DeepseekV2Config(**ds, q_lora_rank=48, topk_method="greedy", rope_parameters=yarn), \
            DeepseekV2ForCausalLM
    return DeepseekV3Config(**ds, q_lora_rank=48, routed_scaling_factor=2.5), DeepseekV3ForCausalLM


def _moe_config(arch: str, common: dict):
    """Mixtures of 8 experts, 2 per token: Mixtral (every layer sparse), Qwen2-MoE (a
    gated shared expert, unnormalised top-k, its first layer dense), Qwen3-MoE (q/k
    norm, normalised top-k)."""
    from transformers import (
        MixtralConfig,
        MixtralForCausalLM,
        Qwen2MoeConfig,
        Qwen2MoeForCausalLM,
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
    )

    if arch == "mixtral":
        return MixtralConfig(**{**common, "intermediate_size": 32}, num_local_experts=8, num_experts_per_tok=2,
                             tie_word_embeddings=False), MixtralForCausalLM
    if arch == "qwen2_moe":
        return Qwen2MoeConfig(**common, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                              shared_expert_intermediate_size=64, norm_topk_prob=False, mlp_only_layers=[0],
                              tie_word_embeddings=False), Qwen2MoeForCausalLM
    return Qwen3MoeConfig(**common, head_dim=32, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                          norm_topk_prob=True, tie_word_embeddings=False), Qwen3MoeForCausalLM


def _gemma_config(arch: str, common: dict):
    """Gemma 2: a sliding layer then a full one, a window of 20, scores and final logits
    soft-capped (caps small enough to bite), query_pre_attn_scalar not head_dim. Gemma 3
    (text): q/k norms, a local RoPE base for its sliding layer and linear scaling on
    the global one's."""
    from transformers import Gemma2Config, Gemma2ForCausalLM, Gemma3ForCausalLM, Gemma3TextConfig

    gemma = dict(common, head_dim=32, query_pre_attn_scalar=24, sliding_window=20,
                 layer_types=["sliding_attention", "full_attention"], hidden_activation="gelu_pytorch_tanh",
                 tie_word_embeddings=True, pad_token_id=0)
    if arch == "gemma2":
        return Gemma2Config(**gemma, attn_logit_softcapping=1.0, final_logit_softcapping=3.0), Gemma2ForCausalLM
    rope = {"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}
    return Gemma3TextConfig(**gemma, rope_parameters=rope), Gemma3ForCausalLM


def build_tiny_model(arch: str, out_dir: Path, seed: int = 0) -> Path:
    """arch: llama (GQA 4:2, llama3 RoPE, tied), mistral (a sliding window of 20),
    qwen2 (qkv bias), qwen3 (q/k norm, head_dim != hidden/heads, untied), olmo2 (norms
    after the sublayers, q/k norms over whole projections), phi3 (fused qkv_proj and
    gate_up_proj tensors, RoPE on half of each head: Phi-4-mini turns 3/4; a window of
    28), llama_mqa (one KV
    head: replicated across tensor-parallel ranks), or one of MOE_ARCHS."""
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        Olmo2Config,
        Olmo2ForCausalLM,
        Phi3Config,
        Phi3ForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    out_dir.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer(out_dir)
    common = dict(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                  bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, rms_norm_eps=1e-6)
    if arch == "llama":
        config = LlamaConfig(**common, tie_word_embeddings=True, rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 256})
        cls = LlamaForCausalLM
    elif arch == "llama_mqa":
        config, cls = LlamaConfig(**{**common, "num_key_value_heads": 1}, tie_word_embeddings=False), LlamaForCausalLM
    elif arch == "mistral":
        # A window shorter than most test prompts, not a multiple of the block size.
        config, cls = MistralConfig(**common, sliding_window=20, tie_word_embeddings=False), MistralForCausalLM
    elif arch == "qwen2":
        config, cls = Qwen2Config(**common, tie_word_embeddings=False), Qwen2ForCausalLM
    elif arch == "qwen3":
        config, cls = Qwen3Config(**common, head_dim=32, tie_word_embeddings=False), Qwen3ForCausalLM
    elif arch == "olmo2":
        config, cls = Olmo2Config(**common, tie_word_embeddings=False), Olmo2ForCausalLM
    elif arch == "phi3":
        # A window shorter than most test prompts. pad_token_id: Phi-3's default, 32000,
        # is past this vocabulary.
        config = Phi3Config(**common, sliding_window=28, pad_token_id=None, tie_word_embeddings=False,
                            rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                             "partial_rotary_factor": 0.5})
        cls = Phi3ForCausalLM
    elif arch in ("gemma2", "gemma3"):
        config, cls = _gemma_config(arch, common)
    elif arch.startswith("deepseek"):
        config, cls = _deepseek_config(arch, common)
    elif arch in MOE_ARCHS:
        config, cls = _moe_config(arch, common)
    else:
        raise ValueError(arch)
    torch.manual_seed(seed)
    model = cls(config)
    # Random init gives near-uniform logits; scale them up so greedy choices are decisive
    # and distinct prompts diverge (flat logits would make every test trivially pass).
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0, 0.15)
            elif "bias" in name or (arch.startswith("gemma") and "norm" in name):
                p.normal_(0, 0.1)  # Gemma's norms scale by 1 + weight: zeros would not test it
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # DeepSeek-V3's: zeros would not test it
                b.normal_(0, 0.1)
    model.save_pretrained(out_dir)
    return out_dir
