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
    """Generating 4x the window, a decoding sequence holds at most the blocks its window
    spans plus the one its next token goes into. Four of them in 8 blocks preempt the
    lowest priority one, whose recompute (prompt and outputs) then outgrows the pool:
    it runs in chunks (kv.chunk_limit) that fit beside its window, and still gives
    HF's tokens. (Before, it waited for all of its blocks at once and the engine
    stopped: "no progress".)"""
    long_prompt, short = random_prompts([5], seed=14)[0], random_prompts([5, 6, 4], seed=15)
    llm = LLM(str(tiny_models["mistral"]), num_kv_blocks=8, block_size=16, async_scheduling=async_scheduling)
    core = llm.core
    held: list[int] = []
    original = core.scheduler.schedule

    def spy():
        out = original()
        held.extend(core.kv.num_held_blocks(s.request.request_id) for s in out.scheduled if s.num_new_tokens == 1)
        return out

    core.scheduler.schedule = spy
    long = core.add_request("long", long_prompt, SamplingParams(max_tokens=220, min_tokens=220, temperature=0.0,
                                                                ignore_eos=True), priority=1)
    for _ in range(150):  # 155 tokens: 10 blocks, more than the pool
        core.step()
    params = SamplingParams(max_tokens=4 * WINDOW, min_tokens=4 * WINDOW, temperature=0.0, ignore_eos=True)
    requests = [core.add_request(f"s{i}", p, params) for i, p in enumerate(short)]
    while core.has_unfinished():
        core.step()
    assert core.scheduler.num_preemptions > 0
    assert [r.output_token_ids for r in requests] == hf_greedy(tiny_models["mistral"], short, max_tokens=4 * WINDOW)
    assert long.output_token_ids == hf_greedy(tiny_models["mistral"], [long_prompt], max_tokens=220)[0]
    assert held and max(held) <= 3
    assert core.kv.num_free_blocks == 8


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


def test_draft_model_never_writes_into_released_places(tiny_models: dict[str, Path],
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A windowed draft model (the target itself) catches a long prompt up: it starts
    after the blocks the prompt released (their table entries are 0, another request's
    block, where its KV would land), and the target's tokens stay HF's."""
    from engine.speculative import draft_model

    model = str(tiny_models["mistral"])
    starts: list[tuple[int, int]] = []  # (catch-up start, first position with a place)
    original = draft_model.DraftModelProposer._catch_up

    def spy(self, work, first, ends, tables, drafts):
        starts.extend((st, self.kv.num_released(s.request.request_id) * 16) for s, st in zip(work, first))
        original(self, work, first, ends, tables, drafts)

    monkeypatch.setattr(draft_model.DraftModelProposer, "_catch_up", spy)
    prompts = random_prompts([10, 150], seed=16)
    llm = LLM(model, block_size=16, speculative_config={"model": model, "num_speculative_tokens": 3})
    params = SamplingParams(max_tokens=30, min_tokens=30, temperature=0.0, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in outs] == hf_greedy(tiny_models["mistral"], prompts, max_tokens=30)
    assert any(place > 0 for _, place in starts) and all(start >= place for start, place in starts)


def test_a_prompt_longer_than_the_pool(tiny_models: dict[str, Path]) -> None:
    """200 prompt tokens (13 blocks) through a pool of 8, chunk by chunk, each chunk's
    early blocks released before the next: HF's tokens."""
    prompts = random_prompts([200], seed=17)
    llm = LLM(str(tiny_models["mistral"]), num_kv_blocks=8, block_size=16)
    params = SamplingParams(max_tokens=40, min_tokens=40, temperature=0.0, ignore_eos=True)
    assert [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == hf_greedy(
        tiny_models["mistral"], prompts, max_tokens=40)
