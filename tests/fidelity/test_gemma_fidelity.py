"""Gemma 2 and 3 (tiny, tests/tiny_models.py: a sliding layer of window 20 and a full
one) against transformers in float32: prompt logprobs through both soft-caps and the
two RoPE bases, chunked across the window's edge; greedy tokens under preemption.
Mixed batches and TP 2 are in test_hf_fidelity.py and test_tp_fidelity.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from tests.fidelity.test_hf_fidelity import hf_greedy, hf_model, random_prompts


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_chunked_prompt_logprobs_equal_hf(tiny_models: dict[str, Path], arch: str) -> None:
    """Logprobs see what argmax cannot: Gemma 2's final soft-cap changes every value."""
    prompt = random_prompts([70], seed=21)[0]
    with torch.no_grad():
        ref = torch.log_softmax(hf_model(str(tiny_models[arch]))(torch.tensor([prompt])).logits[0, :-1].float(), -1)
    llm = LLM(str(tiny_models[arch]), max_num_batched_tokens=16, block_size=16)
    out = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0), use_tqdm=False)[0]
    assert out.prompt_logprobs is not None and out.prompt_logprobs[0] is None
    got = torch.tensor([e.logprob for e in out.prompt_logprobs[1:]])
    torch.testing.assert_close(got, ref[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])], atol=1e-4, rtol=0)


def test_preemption_matches_hf(tiny_models: dict[str, Path]) -> None:
    prompts = random_prompts([40, 35, 50, 45], seed=22)
    llm = LLM(str(tiny_models["gemma2"]), num_kv_blocks=10, block_size=16)
    params = SamplingParams(max_tokens=24, min_tokens=24, temperature=0.0, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.core.scheduler.num_preemptions > 0
    assert [o.token_ids for o in outs] == hf_greedy(tiny_models["gemma2"], prompts, max_tokens=24)
    # A mixed model's global layer reads every block: nothing is released while it runs.
    assert llm.core.kv.sliding_window == 0 and llm.core.kv.num_free_blocks == 10
