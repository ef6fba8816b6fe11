"""Greedy outputs token-identical to transformers `generate` in float32, across features."""

from __future__ import annotations

from functools import cache
from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams

MAX_TOKENS = 12
# min_tokens as hf_greedy's min_new_tokens: EOS masked until the end on both sides (a
# tiny model puts it first now and then, which ignore_eos alone would sample).
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


def random_prompts(lengths: list[int], seed: int, vocab: int = 384) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, vocab, (n,), generator=g).tolist() for n in lengths]


@cache
def hf_model(model_dir: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def hf_greedy(model_dir: Path, prompts: list[list[int]], max_tokens: int = MAX_TOKENS) -> list[list[int]]:
    """One prompt at a time: no padding, so HF's result is the unambiguous reference."""
    model = hf_model(str(model_dir))
    outs = []
    with torch.no_grad():
        for p in prompts:
            ids = model.generate(torch.tensor([p]), max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                                 do_sample=False, pad_token_id=0)
            outs.append(ids[0, len(p):].tolist())
    return outs


def step_tokens(llm: LLM) -> list[int]:
    """The tokens of each step llm's scheduler makes from now on (filled as it runs)."""
    steps: list[int] = []
    original = llm.core.scheduler.schedule

    def spy():
        out = original()
        steps.append(out.num_tokens)
        return out

    llm.core.scheduler.schedule = spy
    return steps


MIXED = random_prompts([1, 7, 16, 17, 33, 64, 100, 150], seed=1)


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3", "olmo2", "phi3", "gemma2", "gemma3"])
def test_mixed_batch_matches_hf(tiny_models: dict[str, Path], arch: str) -> None:
    llm = LLM(str(tiny_models[arch]), enable_prefix_caching=False)
    outs = llm.generate(MIXED, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == hf_greedy(tiny_models[arch], MIXED)
    assert all(o.finish_reason == "length" for o in outs)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_prefix_caching_hits_and_matches_hf(tiny_models: dict[str, Path], arch: str) -> None:
    shared = random_prompts([48], seed=2)[0]
    tails = random_prompts([3, 9, 20, 31], seed=3)
    prompts = [shared + t for t in tails] + [shared]  # shared alone: exactly 3 full blocks
    llm = LLM(str(tiny_models[arch]), block_size=16)
    first = llm.generate(prompts[:1], GREEDY, use_tqdm=False)  # fills the cache
    rest = llm.generate(prompts[1:], GREEDY, use_tqdm=False)
    outs = first + rest
    assert [o.token_ids for o in outs] == hf_greedy(tiny_models[arch], prompts)
    # Every later request reuses the 3 shared blocks, except the bare prefix, whose last
    # block must be recomputed to have logits to sample from.
    assert [o.num_cached_tokens for o in rest] == [48, 48, 48, 32]
    assert llm.core.kv.pool.num_cache_hits >= 11


@pytest.mark.parametrize("arch,async_scheduling", [("llama", False), ("qwen2", False), ("llama", True)])
def test_chunked_prefill_matches_hf(tiny_models: dict[str, Path], arch: str, async_scheduling: bool) -> None:
    prompts = random_prompts([150, 97, 5], seed=4)
    llm = LLM(str(tiny_models[arch]), max_num_batched_tokens=8, enable_prefix_caching=False,
              async_scheduling=async_scheduling)
    steps = step_tokens(llm)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == hf_greedy(tiny_models[arch], prompts)
    assert max(steps) <= 8  # the budget really chunked the 150-token prompt


@pytest.mark.parametrize("arch,async_scheduling", [("llama", False), ("qwen3", False), ("qwen3", True)])
def test_preemption_matches_hf(tiny_models: dict[str, Path], arch: str, async_scheduling: bool) -> None:
    prompts = random_prompts([40, 35, 50, 45, 30, 38], seed=5)
    # 12 blocks x 16 tokens = 192 slots for ~6 x 60 tokens: requests must be preempted.
    llm = LLM(str(tiny_models[arch]), num_kv_blocks=12, block_size=16, async_scheduling=async_scheduling)
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.core.scheduler.num_preemptions > 0
    assert [o.token_ids for o in outs] == hf_greedy(tiny_models[arch], prompts, max_tokens=20)
    assert llm.core.kv.num_free_blocks == 12


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_eos_stops_like_hf(tiny_models: dict[str, Path], async_scheduling: bool) -> None:
    """Without ignore_eos, the engine stops exactly where HF's generate stops (with async
    scheduling, a step later on the host, with nothing of that step kept)."""
    model_dir = tiny_models["qwen3"]
    prompts = random_prompts([2, 12, 30], seed=0)  # the first one reaches EOS after 5 tokens
    llm = LLM(str(model_dir), async_scheduling=async_scheduling)
    outs = llm.generate(prompts, SamplingParams(max_tokens=40, temperature=0.0), use_tqdm=False)
    model = hf_model(str(model_dir))
    for p, o in zip(prompts, outs):
        ref = model.generate(torch.tensor([p]), max_new_tokens=40, do_sample=False, pad_token_id=0)[0, len(p):]
        assert o.token_ids == ref.tolist()
    assert outs[0].finish_reason == "stop" and outs[0].token_ids[-1] == llm.tokenizer.eos_token_id
