"""benchmarks/offline/roofline/analytic.py against a decode and a prefill step worked out by
hand for one tiny config (the arithmetic is in the comments), and its parameter count
against the Hugging Face model of the same config."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.offline.roofline.analytic import ModelShape, Step, step_cost
from benchmarks.offline.roofline.roofs import Roof

# hidden 64, intermediate 128, 2 layers, 4 heads, 2 KV heads, head dim 16, vocab 384:
# q width 4*16 = 64, kv width 2*16 = 32.
TINY = ModelShape(hidden=64, intermediate=128, layers=2, heads=4, kv_heads=2, head_dim=16, vocab=384,
                  tied_embeddings=True)
FP32 = 4


def test_decode_step_by_hand() -> None:
    cost = step_cost(TINY, Step.decode(batch=2, context=10), FP32)  # 2 tokens, 2 logits rows
    by_class = {c.name: c for c in cost.classes}
    # Weights per layer: qkv 64*(64+2*32) = 8192, o 64*64 = 4096, gate_up + down
    # 3*64*128 = 24576: 36864; x 2 layers = 73728.
    assert TINY.linear_params == 73728
    # FLOPs 2 * 2 tokens * 73728 = 294912. Activations per token per layer: qkv 64 in +
    # 128 out, o 64 + 64, gate_up 64 + 256, down 128 + 64 = 832; x 2 tokens x 2 layers =
    # 3328. Bytes 4 * (73728 + 3328) = 308224.
    assert (by_class["linears"].flops, by_class["linears"].bytes) == (294912, 308224)
    # Each sequence's one query sees 10 cached keys + its own = 11; 2 sequences: 22
    # pairs. Per pair per layer QK^T 2*64 + PV 2*64 = 256 FLOPs: 22 * 256 * 2 = 11264.
    # KV read 2 seqs * 11 tokens * (k+v) 64 = 1408, q read + out written 2 * 2 * 64 =
    # 256; (1408 + 256) * 2 layers * 4 bytes = 13312.
    assert (by_class["attention"].flops, by_class["attention"].bytes) == (11264, 13312)
    # New k and v (2 tokens * 64) read, then written: 2 * 128 * 2 layers * 4 = 2048.
    assert (by_class["kv_write"].flops, by_class["kv_write"].bytes) == (0, 2048)
    # 2 rows * 2 * 64 * 384 = 98304 FLOPs; weights 384*64 = 24576 + 2 hidden rows 128,
    # times 4 bytes = 98816, float32 logits written and read 2 * 2 * 384 * 4 = 6144:
    # 104960.
    assert (by_class["lm_head"].flops, by_class["lm_head"].bytes) == (98304, 104960)
    # Elements: embedding 2 tokens * 64 read + written = 256; per layer two add+RMSNorms
    # 2 * (4 * 2 * 64 + 64 weights) = 1152, rotary 2 * 2 * 96 = 384, SiLU-and-mul
    # 3 * 2 * 128 = 768: 2304 x 2 layers = 4608; final norm 3 * 2 * 64 + 64 = 448.
    # 256 + 4608 + 448 = 5312 elements * 4 = 21248 bytes. FLOPs per layer: norms
    # 2 * 5 * 128 = 1280, rotary 3 * 192 = 576, SiLU-and-mul 5 * 256 = 1280: 3136 x 2
    # = 6272, final norm 5 * 128 = 640: 6912.
    assert (by_class["elementwise"].flops, by_class["elementwise"].bytes) == (6912, 21248)
    assert (cost.flops, cost.bytes) == (411392, 449792)

    # 1 GB/s and 0.5 GFLOP/s: a byte costs 1 ns, a FLOP 2 ns. Per class, the larger:
    # linears 2 * 294912 = 589824 ns (compute), attention 22528 (compute), kv_write
    # 2048 (memory), lm_head 196608 (compute), elementwise 21248 (memory) = 832256 ns.
    roof = Roof("test", bytes_per_s=1e9, flops_per_s=0.5e9)
    assert cost.floor(roof) == pytest.approx(832256e-9)
    assert [c.bound(roof) for c in cost.classes] == ["compute", "compute", "memory", "compute", "memory"]
    assert cost.bound(roof) == "compute"
    # Whole step: max(449792 ns, 2 * 411392 = 822784 ns).
    assert cost.whole_step_floor(roof) == pytest.approx(822784e-9)


def test_prefill_chunk_by_hand() -> None:
    cost = step_cost(TINY, Step.prefill(chunk=4, context=8), FP32)
    by_class = {c.name: c for c in cost.classes}
    # Query j of the chunk (1..4) sees 8 cached keys + j: 9+10+11+12 = 42 pairs,
    # * 256 FLOPs * 2 layers = 21504. KV read 12 tokens * 64 = 768, q + out 2 * 4 * 64
    # = 512; (768 + 512) * 2 layers * 4 bytes = 10240.
    assert (by_class["attention"].flops, by_class["attention"].bytes) == (21504, 10240)
    # One logits row: 2 * 64 * 384 = 49152 FLOPs; (24576 + 64) * 4 + 2 * 384 * 4 = 101632.
    assert (by_class["lm_head"].flops, by_class["lm_head"].bytes) == (49152, 101632)
    # 4 tokens through the linears: 2 * 4 * 73728 = 589824 FLOPs.
    assert by_class["linears"].flops == 589824


def test_shape_from_model_dir_counts_the_hf_models_parameters(tmp_path: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    (tmp_path / "config.json").write_text(json.dumps({**config.to_dict(), "architectures": ["LlamaForCausalLM"]}))
    shape = ModelShape.from_model_dir(tmp_path)
    assert shape == TINY
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    linears = sum(p.numel() for n, p in model.named_parameters() if n.endswith("proj.weight"))
    assert shape.linear_params == linears
    assert shape.stored_params == sum(p.numel() for p in model.parameters())


def test_bad_shapes_and_steps_are_named() -> None:
    with pytest.raises(ValueError, match="kv_heads must be >= 1, got 0"):
        ModelShape(64, 128, 2, 4, 0, 16, 384, True)
    with pytest.raises(ValueError, match="batch >= 1"):
        Step.decode(batch=0, context=5)
    with pytest.raises(ValueError, match="must be > 0"):
        Roof("bad", 0.0, 1.0)
