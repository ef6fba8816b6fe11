"""The engine on the Triton kernels (under the interpreter on CPU) matches HF greedy
output in float32: mixed prefill/decode batches, prefix-cache hits, chunked prefill."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine import LLM, SamplingParams
from tests.fidelity.test_hf_fidelity import GREEDY, MIXED, hf_greedy, random_prompts


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_mixed_batch_matches_hf(tiny_models: dict[str, Path], arch: str) -> None:
    llm = LLM(str(tiny_models[arch]), attention_backend="triton", enable_prefix_caching=False)
    outs = llm.generate(MIXED, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == hf_greedy(tiny_models[arch], MIXED)


def test_cached_prefix_and_chunks_match_hf(tiny_models: dict[str, Path]) -> None:
    shared = random_prompts([48], seed=2)[0]
    prompts = [shared + t for t in random_prompts([3, 20], seed=3)] + random_prompts([70], seed=5)
    llm = LLM(str(tiny_models["llama"]), attention_backend="triton", block_size=16,
              max_num_batched_tokens=24)
    outs = llm.generate(prompts[:1], GREEDY, use_tqdm=False) + llm.generate(prompts[1:], GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == hf_greedy(tiny_models["llama"], prompts)
    assert outs[1].num_cached_tokens == 48


def test_latent_attention_matches_hf(moe_models: dict[str, Path]) -> None:
    """DeepSeek-V3 (MLA) on the Triton backend: decode rows through the MLA decode kernel,
    prompt chunks (24-token steps) over a cached prefix through torch."""
    model = moe_models["deepseek_v3"]
    shared = random_prompts([48], seed=2)[0]
    prompts = [shared + t for t in random_prompts([3, 20], seed=3)]
    llm = LLM(str(model), attention_backend="triton", block_size=16, max_num_batched_tokens=24)
    outs = llm.generate(prompts[:1], GREEDY, use_tqdm=False) + llm.generate(prompts[1:] + MIXED, GREEDY,
                                                                               use_tqdm=False)
    assert [o.token_ids for o in outs] == hf_greedy(model, prompts + MIXED)
    assert outs[1].num_cached_tokens == 48


def test_latent_decode_splits_a_long_context(moe_models: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """The MLA decode kernel gets its split-KV factor for the step's longest context (it
    ran unsplit: one program per sequence and 16 heads, most of a GPU idle)."""
    from engine.kernels import mla_decode

    splits: list[int] = []
    kernel = mla_decode.mla_decode_attention

    def recording(*args, num_splits: int = 1, **kwargs) -> None:
        splits.append(num_splits)
        kernel(*args, num_splits=num_splits, **kwargs)

    monkeypatch.setattr(mla_decode, "mla_decode_attention", recording)
    prompt = random_prompts([mla_decode.SPLIT_TOKENS + 40], seed=9)  # past one split's tokens
    model = moe_models["deepseek_v3"]
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    outs = LLM(str(model), attention_backend="triton").generate(prompt, params, use_tqdm=False)
    assert max(splits) > 1
    assert outs[0].token_ids == LLM(str(model)).generate(prompt, params, use_tqdm=False)[0].token_ids
