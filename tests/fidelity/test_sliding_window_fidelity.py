"""Sliding-window models (the tiny Mistral: a window of 20 on every layer) greedy
token-identical to transformers in float32 wherever the window's edge falls: in
chunks, across prefix hits, under preemption and speculation; and their KV follows
the window (blocks before it released as generation goes on)."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine import LLM, SamplingParams
from tests.fidelity.test_hf_fidelity import GREEDY, hf_greedy, random_prompts, step_tokens

WINDOW = 20  # tests/tiny_models.py's mistral


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_chunks_cross_the_window_edge(tiny_models: dict[str, Path], async_scheduling: bool) -> None:
    prompts = random_prompts([150, 47, 21, 5], seed=11)
    llm = LLM(str(tiny_models["mistral"]), max_num_batched_tokens=8, block_size=16,
              async_scheduling=async_scheduling)
    steps = step_tokens(llm)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == hf_greedy(tiny_models["mistral"], prompts)
    assert max(steps) <= 8


def test_prefix_hits_across_the_window_edge(tiny_models: dict[str, Path]) -> None:
    """A 48-token shared prefix (3 blocks): a later request's first new token sees only
    the last 20 of it, so its hits include blocks wholly out of its window."""
    shared = random_prompts([48], seed=12)[0]
    prompts = [shared + t for t in random_prompts([3, 9, 30], seed=13)]
    llm = LLM(str(tiny_models["mistral"]), block_size=16)
    first = llm.generate(prompts[:1], GREEDY, use_tqdm=False)
    rest = llm.generate(prompts[1:], GREEDY, use_tqdm=False)
    assert [o.token_ids for o in first + rest] == hf_greedy(tiny_models["mistral"], prompts)
    assert [o.num_cached_tokens for o in rest] == [48, 48]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_preemption_and_blocks_held_over_a_long_generation(tiny_models: dict[str, Path],
                                                          async_scheduling: bool) -> None:
    """Generating 4x the window, a sequence holds at most the blocks its window spans
    plus the one its next token goes into; with 5 blocks, two 20-token prompts hold 4,
    and both growing into their third block at once preempts one."""
    prompts = random_prompts([20, 21, 19, 22], seed=14)
    llm = LLM(str(tiny_models["mistral"]), num_kv_blocks=5, block_size=16, async_scheduling=async_scheduling)
    held: list[int] = []
    original = llm.core.scheduler.schedule

    def spy():
        out = original()
        held.extend(llm.core.kv.num_held_blocks(s.request.request_id) for s in out.scheduled
                    if s.request.num_computed_tokens >= s.request.num_prompt_tokens)
        return out

    llm.core.scheduler.schedule = spy
    params = SamplingParams(max_tokens=4 * WINDOW, min_tokens=4 * WINDOW, temperature=0.0, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in outs] == hf_greedy(tiny_models["mistral"], prompts, max_tokens=4 * WINDOW)
    assert llm.core.scheduler.num_preemptions > 0
    # Decoding, the window's 20 tokens span at most 3 blocks of 16; the next token's
    # block is among them or one more (async scheduling: a step later).
    assert held and max(held) <= 3
    assert llm.core.kv.num_free_blocks == 5


def test_speculative_verify_rows_keep_the_window(tiny_models: dict[str, Path],
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Verify rows (a decode row per draft) each see their own last 20 positions:
    drafts always right, so several rows per step reach past the window's edge."""
    from engine.speculative import speculator

    prompts = random_prompts([30, 45], seed=15)
    expected = hf_greedy(tiny_models["mistral"], prompts, max_tokens=40)

    def propose(sequence, room, *_):
        prompt, out = next((p, e) for p, e in zip(prompts, expected) if sequence[:len(p)] == p)
        return out[len(sequence) - len(prompt):][:room]

    monkeypatch.setattr(speculator, "propose_ngram", propose)
    llm = LLM(str(tiny_models["mistral"]), block_size=16, speculative_config={"num_speculative_tokens": 5})
    params = SamplingParams(max_tokens=40, min_tokens=40, temperature=0.0, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in outs] == expected
    assert llm.core.speculator.stats.num_accepted_tokens > 20
