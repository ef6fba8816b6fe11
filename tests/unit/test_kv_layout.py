"""The KV cache layout, [blocks, kv_heads, layers, 2, block_size, head_dim], pinned.

What tensor-parallel transfers rely on: a slice of one block's heads is one contiguous
byte range, a run of blocks with all heads is one too, and the K/V the model stores for
a token lands at kv_cache[block, head, layer, 0 (K) / 1 (V), offset] with every backend.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from engine.kv_cache.layout import layer_view
from engine.model.config import ModelConfig
from engine.runner import allocate_kv_cache
from kv_transfer.compat import LAYOUT, KVCompat


def test_head_slices_and_block_runs_are_contiguous_byte_ranges(llama_dir: Path) -> None:
    cfg = ModelConfig.from_model_dir(str(llama_dir))
    num_blocks, block_size, heads = 5, 4, 4  # 4 heads: a rank's share may differ from the model's
    cache = allocate_kv_cache(cfg, num_blocks, block_size, torch.float32, "cpu", num_kv_heads=heads)
    assert cache.shape == (num_blocks, heads, cfg.num_layers, 2, block_size, cfg.head_dim)
    item = cache.element_size()
    head_bytes = cfg.num_layers * 2 * block_size * cfg.head_dim * item  # one head of one block
    block_bytes = heads * head_bytes
    compat = KVCompat.from_caches([cache], "m", heads, [(0, heads)])
    assert compat.block_bytes == block_bytes and compat.num_kv_heads == heads
    assert compat.layout == LAYOUT == "block_major:[blocks,kv_heads,layers,2,block_size,head_dim]"
    for b in range(num_blocks):
        for h0 in range(heads):
            for h1 in range(h0 + 1, heads + 1):
                region = cache[b, h0:h1]
                assert region.is_contiguous()
                assert region.data_ptr() - cache.data_ptr() == b * block_bytes + h0 * head_bytes
                assert region.numel() * item == (h1 - h0) * head_bytes
    assert cache[1:4].is_contiguous() and cache[1:4].data_ptr() - cache.data_ptr() == block_bytes
    # The model's own head count when none is given.
    default = allocate_kv_cache(cfg, 2, block_size, torch.float32, "cpu")
    assert default.shape[1] == cfg.num_kv_heads
    with pytest.raises(ValueError, match="num_kv_heads must be >= 1, got 0"):
        allocate_kv_cache(cfg, 2, block_size, torch.float32, "cpu", num_kv_heads=0)


def test_layer_view_aliases_the_documented_index(llama_dir: Path) -> None:
    cfg = ModelConfig.from_model_dir(str(llama_dir))
    cache = allocate_kv_cache(cfg, 3, 4, torch.float32, "cpu")
    cache.copy_(torch.arange(cache.numel(), dtype=torch.float32).view(cache.shape))
    for layer in range(cfg.num_layers):
        view = layer_view(cache, layer)
        assert view.shape == (3, 2, 4, cfg.num_kv_heads, cfg.head_dim)
        for b, kv, o, h in ((0, 0, 0, 0), (2, 1, 3, cfg.num_kv_heads - 1), (1, 0, 2, 1)):
            assert torch.equal(view[b, kv, o, h], cache[b, h, layer, kv, o])


@pytest.mark.parametrize("backend", ["torch", "reference", "triton"])
def test_stored_kv_lands_at_the_documented_index(llama_dir: Path, backend: str,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    threads = torch.get_num_threads()
    llm = LLM(str(llama_dir), attention_backend=backend, num_kv_blocks=16, block_size=8, num_threads=1)
    torch.set_num_threads(threads)
    core = llm.core
    impl = core.runner.attention_backend
    stores: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
    real_store = impl.store_kv

    def recording_store(layer_cache, key, value, md):
        stores.append((key.clone(), value.clone(), md.slot_mapping.clone()))
        real_store(layer_cache, key, value, md)

    monkeypatch.setattr(impl, "store_kv", recording_store)
    # Two prompts in one step, over block boundaries, then decode steps.
    llm.generate([list(range(5, 16)), [20, 21, 22]],
                 SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True), use_tqdm=False)
    layers, block_size = core.model_config.num_layers, 8
    assert stores and len(stores) % layers == 0
    checked = 0
    for i, (key, value, slots) in enumerate(stores):
        layer = i % layers  # each step stores layer 0, 1, ... in order
        for t, slot in enumerate(slots.tolist()):
            if slot < 0:
                continue  # padding
            b, o = divmod(slot, block_size)
            assert torch.equal(core.kv_cache[b, :, layer, 0, o], key[t]), (i, t, slot)
            assert torch.equal(core.kv_cache[b, :, layer, 1, o], value[t]), (i, t, slot)
            checked += 1
    assert checked == layers * (11 + 3 + 2 * 2)  # prompt tokens, then two decode tokens each
