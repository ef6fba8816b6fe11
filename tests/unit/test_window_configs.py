"""Each layer's sliding window, Gemma's parameters and the refusals, read from
config.json as transformers 5.24 reads them (its defaults where a config says nothing)."""

from __future__ import annotations

import pytest

from engine.model.config import ModelConfig, release_window

BASE = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=2,
            num_key_value_heads=1)


def config(arch: str, **fields) -> ModelConfig:
    return ModelConfig.from_dict({**BASE, "architectures": [arch], **fields})


@pytest.mark.parametrize("arch,fields,windows", [
    ("MistralForCausalLM", dict(sliding_window=8), (8, 8, 8, 8)),
    ("MistralForCausalLM", dict(sliding_window=None), ()),
    # transformers' Mistral windows every layer, whatever a layer_types key says.
    ("MistralForCausalLM", dict(sliding_window=8, layer_types=["full_attention"] * 4), (8, 8, 8, 8)),
    # Llama's attends over every position, whatever the config says.
    ("LlamaForCausalLM", dict(sliding_window=8), ()),
    ("Phi3ForCausalLM", dict(sliding_window=8), (8, 8, 8, 8)),
    # Qwen2/3: a window only with use_sliding_window, from layer max_window_layers on.
    ("Qwen2ForCausalLM", dict(sliding_window=8), ()),
    ("Qwen2ForCausalLM", dict(sliding_window=8, use_sliding_window=True, max_window_layers=2), (0, 0, 8, 8)),
    ("Qwen3ForCausalLM", dict(sliding_window=8, use_sliding_window=True, max_window_layers=3), (0, 0, 0, 8)),
    # Qwen2-MoE: the even layers below max_window_layers.
    ("Qwen2MoeForCausalLM", dict(sliding_window=8, use_sliding_window=True, max_window_layers=3, num_experts=0,
                                 num_experts_per_tok=1, moe_intermediate_size=8), (8, 0, 8, 0)),
    # Gemma 2 alternates from a sliding layer; Gemma 3 slides on 5 of every 6 (its pattern).
    ("Gemma2ForCausalLM", dict(sliding_window=8), (8, 0, 8, 0)),
    ("Gemma2ForCausalLM", dict(), (4096, 0, 4096, 0)),  # transformers' default window
    ("Gemma3ForCausalLM", dict(sliding_window=8, sliding_window_pattern=3), (8, 8, 0, 8)),
    ("Gemma3ForCausalLM", dict(sliding_window=8, layer_types=["full_attention"] * 3 + ["sliding_attention"]),
     (0, 0, 0, 8)),
])
def test_layer_windows(arch: str, fields: dict, windows: tuple[int, ...]) -> None:
    mc = config(arch, **fields)
    assert mc.layer_windows == windows
    assert [mc.layer_window(i) for i in range(4)] == list(windows or (0,) * 4)
    # Blocks are released only when every layer keeps to a window.
    assert mc.uniform_window == (8 if windows and all(windows) else 0)


def test_release_window_needs_every_model_windowed() -> None:
    windowed, full = config("MistralForCausalLM", sliding_window=8), config("MistralForCausalLM")
    assert release_window(windowed) == 8
    assert release_window(windowed, config("MistralForCausalLM", sliding_window=16)) == 16
    assert release_window(windowed, full) == 0  # a full-attention draft reads every block


def test_gemma_parameters() -> None:
    g2 = config("Gemma2ForCausalLM", sliding_window=8, query_pre_attn_scalar=16, attn_logit_softcapping=50.0,
                final_logit_softcapping=30.0)
    assert g2.gemma is not None and g2.gemma.query_scale == 0.25 and g2.norm_placement == "sandwich"
    assert (g2.gemma.attn_softcap, g2.gemma.final_softcap, g2.gemma.local_rope_theta) == (50.0, 30.0, None)
    assert g2.tie_word_embeddings and g2.hidden_act == "gelu_pytorch_tanh" and g2.qk_norm is None
    # Gemma 3 as transformers 5 writes it (a RoPE per layer kind) and as older configs did.
    g3 = config("Gemma3ForCausalLM", sliding_window=8, rope_parameters={
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})
    assert g3.gemma is not None and g3.gemma.local_rope_theta == 1e4 and g3.gemma.local_layers == (0, 1, 2, 3)
    assert g3.rope_theta == 1e6 and g3.rope_scaling == {"factor": 8.0, "rope_type": "linear"}
    assert g3.qk_norm == "head" and g3.gemma.attn_softcap == 0.0
    old = config("Gemma3ForCausalLM", sliding_window=8, rope_local_base_freq=2e4)
    assert old.gemma is not None and old.gemma.local_rope_theta == 2e4 and old.rope_theta == 1e6  # its default
    # Gemma 2's caps default on, as transformers' Gemma2Config has them.
    bare = config("Gemma2ForCausalLM")
    assert bare.gemma is not None and (bare.gemma.attn_softcap, bare.gemma.final_softcap) == (50.0, 30.0)


@pytest.mark.parametrize("arch,fields,error", [
    ("MistralForCausalLM", dict(sliding_window=-4), "sliding_window must be a positive integer or null, got -4"),
    ("Gemma2ForCausalLM", dict(sliding_window=8, layer_types=["sliding_attention"] * 3),
     "layer_types must list 4 entries"),
    ("Gemma2ForCausalLM", dict(sliding_window=8, layer_types=["local"] * 4), "layer_types must list 4 entries"),
    ("Gemma2ForCausalLM", dict(attn_logit_softcapping=-1.0), "must be positive or null, got \\[-1.0, 30.0\\]"),
    ("Gemma2ForCausalLM", dict(hidden_activation="relu"), "unsupported hidden_activation 'relu'"),
    ("Gemma3ForCausalLM", dict(rope_parameters={"full_attention": {"rope_type": "default"},
                                                "sliding_attention": {"rope_type": "yarn", "factor": 2.0}}),
     "unsupported rope_type 'yarn' for Gemma 3's sliding layers"),
])
def test_bad_configs_are_named(arch: str, fields: dict, error: str) -> None:
    with pytest.raises(ValueError, match=error):
        config(arch, **fields)
