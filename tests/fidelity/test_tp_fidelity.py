"""Tensor parallelism (2 ranks, gloo on CPU): greedy float32 tokens identical to
transformers, with prefix caching, chunked prefill and preemption exercised, and with
a single KV head replicated on both ranks; sliding windows (mistral, phi3, gemma2/3) included."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine import LLM, SamplingParams
from tests.fidelity.test_hf_fidelity import GREEDY, hf_greedy, random_prompts, step_tokens

SHARED = random_prompts([48], seed=12)[0]
PROMPTS = random_prompts([1, 7, 33, 100, 150], seed=11) + [SHARED + t for t in random_prompts([5, 21], seed=13)]


def tp_llm(model_dir: Path, **options) -> LLM:
    return LLM(str(model_dir), tensor_parallel_size=2, num_threads=1, **options)


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3", "mqa", "olmo2", "phi3", "gemma2", "gemma3"])
def test_tp2_matches_hf_with_chunks_and_prefix_hits(tiny_models: dict[str, Path], mqa_model_dir: Path,
                                                    arch: str) -> None:
    model_dir = mqa_model_dir if arch == "mqa" else tiny_models[arch]
    llm = tp_llm(model_dir, max_num_batched_tokens=32, block_size=16)
    try:
        assert llm.core.shard.num_kv_heads == 1 and llm.core.kv_cache.shape[0] > 0
        steps = step_tokens(llm)
        first = llm.generate([SHARED], GREEDY, use_tqdm=False)  # fills the prefix cache
        rest = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert [o.token_ids for o in first + rest] == hf_greedy(model_dir, [SHARED] + PROMPTS)
        assert max(steps) <= 32  # the 100- and 150-token prompts went in chunks
        assert [o.num_cached_tokens for o in rest[-2:]] == [48, 48]  # prefix hits on rank 0's blocks
    finally:
        llm.core.close()


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_tp2_preemption_matches_hf(tiny_models: dict[str, Path], async_scheduling: bool) -> None:
    prompts = random_prompts([40, 35, 50, 45, 30, 38], seed=5)
    llm = tp_llm(tiny_models["llama"], num_kv_blocks=12, block_size=16, async_scheduling=async_scheduling)
    try:
        params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert llm.core.scheduler.num_preemptions > 0
        assert [o.token_ids for o in outs] == hf_greedy(tiny_models["llama"], prompts, max_tokens=20)
        assert llm.core.kv.num_free_blocks == 12
    finally:
        llm.core.close()


def test_unshardable_model_is_refused_before_any_process_starts(tiny_models: dict[str, Path]) -> None:
    with pytest.raises(ValueError, match="4 attention heads do not divide by tensor_parallel_size 3"):
        LLM(str(tiny_models["llama"]), tensor_parallel_size=3)


def test_tp2_speculative_matches_hf(tiny_models: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """Verify steps (a logits row per draft) go through the step broadcast like any
    other: drafts that are always right, then always wrong."""
    from engine.speculative import speculator

    prompts = PROMPTS[1:3]
    expected = hf_greedy(tiny_models["llama"], prompts)
    for wrong in (False, True):
        def propose(sequence, room, *_, wrong=wrong):
            prompt, out = next((p, e) for p, e in zip(prompts, expected) if sequence[:len(p)] == p)
            return [(t + wrong) % 384 for t in out[len(sequence) - len(prompt):][:room]]

        monkeypatch.setattr(speculator, "propose_ngram", propose)
        llm = tp_llm(tiny_models["llama"], speculative_config={"num_speculative_tokens": 3})
        try:
            assert [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == expected
            stats = llm.core.speculator.stats
            assert stats.num_draft_tokens > 0 and (stats.num_accepted_tokens == 0) == wrong
        finally:
            llm.core.close()
