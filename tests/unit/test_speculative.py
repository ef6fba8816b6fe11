"""Speculative decoding (engine/speculative): greedy outputs token-identical to the
engine without it and to Hugging Face transformers, in float32, whatever the drafts:
n-grams, drafts that are always right (acceptance 1) and always wrong (acceptance 0),
across chunked prefill, prefix caching, preemption, max_tokens and logprobs."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.speculative import speculator as speculator_module
from engine.speculative.config import SpeculativeConfig
from engine.speculative.ngram import propose_ngram
from tests.fidelity.test_hf_fidelity import hf_greedy, random_prompts

MAX_TOKENS = 24
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
# Random prompts, and prompts that repeat a pattern (n-grams find drafts there).
PROMPTS = random_prompts([5, 23, 40], seed=3) + [[7, 8, 9, 10, 11] * 6, [3, 4] * 12 + [5]]


def llm(model: Path, k: int | None = None, **options) -> LLM:
    spec = None if k is None else {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 1}
    return LLM(str(model), speculative_config=spec, **{"num_kv_blocks": 64, "block_size": 16, **options})


def tokens(model: LLM, prompts=PROMPTS, params=GREEDY) -> list[list[int]]:
    return [o.token_ids for o in model.generate(prompts, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def reference(llama_dir: Path) -> list[list[int]]:
    return tokens(llm(llama_dir))


def test_ngram_proposals() -> None:
    assert propose_ngram([1, 2, 3, 9, 1, 2, 3], 3, 1, 3) == [9, 1, 2]
    assert propose_ngram([1, 2, 3, 9, 1, 2, 3], 1, 1, 3) == [9]
    # The latest earlier occurrence, and the longest n that occurs.
    assert propose_ngram([5, 1, 7, 6, 1, 8, 2, 1], 2, 1, 3) == [8, 2]
    assert propose_ngram([4, 5, 6, 4, 5, 7, 1, 4, 5, 6], 2, 1, 3) == [4, 5]
    assert propose_ngram([1, 2, 3, 4], 3, 1, 3) == []  # nothing repeats
    assert propose_ngram([1, 2, 3, 1], 3, 2, 3) == []  # only a 1-gram repeats
    assert propose_ngram([1], 3, 1, 2) == []
    # A repeating pattern repeats on past the sequence's end.
    assert propose_ngram([1, 1], 3, 1, 2) == [1, 1, 1]
    assert propose_ngram([9, 4, 5, 6, 4, 5, 6, 4], 5, 1, 3) == [5, 6, 4, 5, 6]


def test_ngram_proposals_match_a_brute_force_search() -> None:
    def brute(tokens: list[int], max_drafts: int, min_n: int, max_n: int) -> list[int]:
        for n in range(max_n, min_n - 1, -1):
            for i in range(len(tokens) - n - 1, -1, -1):  # latest first; a token must follow the match
                if n < len(tokens) and tokens[i:i + n] == tokens[len(tokens) - n:]:
                    ext = list(tokens)
                    while len(ext) < len(tokens) + max_drafts:
                        ext.append(ext[i + n + len(ext) - len(tokens)])
                    return ext[len(tokens):]
        return []

    rng = random.Random(0)
    for _ in range(3000):
        tokens = [rng.randrange(rng.randint(1, 6)) for _ in range(rng.randint(1, 50))]
        lo, hi = sorted((rng.randint(1, 4), rng.randint(1, 6)))
        m = rng.randint(1, 6)
        assert propose_ngram(tokens, m, lo, hi) == brute(tokens, m, lo, hi), (tokens, m, lo, hi)


@pytest.mark.parametrize("k", [1, 3, 5])
def test_ngram_greedy_matches_plain_engine_and_hf(llama_dir: Path, reference: list[list[int]], k: int) -> None:
    model = llm(llama_dir, k)
    assert tokens(model) == reference
    stats = model.core.speculator.stats
    assert stats.num_draft_tokens > 0, "no n-gram drafts were tried: the test proves nothing"
    if k == 3:
        assert reference == hf_greedy(llama_dir, PROMPTS, MAX_TOKENS)


def _oracle(reference: dict[tuple[int, ...], list[int]], wrong: bool):
    """A proposer that knows each prompt's greedy continuation: its drafts are all
    right, or (wrong) each is off by one."""
    def propose(sequence, room, *_):
        for prompt, out in reference.items():
            if tuple(sequence[:len(prompt)]) == prompt:
                ahead = out[len(sequence) - len(prompt):][:room]
                return [(t + 1) % 384 for t in ahead] if wrong else ahead
        raise AssertionError("unknown sequence")
    return propose


@pytest.mark.parametrize("wrong", [False, True])
@pytest.mark.parametrize("options", [{}, {"max_num_batched_tokens": 8, "num_kv_blocks": 12},
                                     {"enable_prefix_caching": False}])
def test_drafts_always_right_or_always_wrong(llama_dir: Path, reference: list[list[int]], monkeypatch,
                                             wrong: bool, options: dict) -> None:
    """Acceptance 1 and acceptance 0 give the same tokens; a small pool preempts and
    a small budget truncates drafts and chunks prompts."""
    monkeypatch.setattr(speculator_module, "propose_ngram",
                        _oracle({tuple(p): r for p, r in zip(PROMPTS, reference)}, wrong))
    model = llm(llama_dir, 4, **options)
    assert tokens(model) == reference
    stats = model.core.speculator.stats
    assert stats.num_draft_tokens > 0
    if wrong:
        assert stats.num_accepted_tokens == 0
    else:
        assert stats.num_accepted_tokens == stats.num_draft_tokens
        assert stats.mean_accepted_length > 3


def test_low_acceptance_stops_speculating(llama_dir: Path, reference: list[list[int]], monkeypatch) -> None:
    monkeypatch.setattr(speculator_module, "propose_ngram",
                        _oracle({tuple(p): r for p, r in zip(PROMPTS, reference)}, wrong=True))
    model = LLM(str(llama_dir), num_kv_blocks=64, speculative_config={
        "method": "ngram", "num_speculative_tokens": 2, "acceptance_window": 4, "min_acceptance_rate": 0.5})
    assert tokens(model) == reference
    stats = model.core.speculator.stats
    assert stats.num_disabled == len(PROMPTS)
    assert stats.num_draft_tokens == 4 * len(PROMPTS)  # two steps each, then none


def test_max_tokens_and_stops_are_never_overshot(llama_dir: Path, reference: list[list[int]], monkeypatch) -> None:
    monkeypatch.setattr(speculator_module, "propose_ngram",
                        _oracle({tuple(p): r for p, r in zip(PROMPTS, reference)}, wrong=False))
    model = llm(llama_dir, 5)
    for max_tokens in (1, 2, 7):
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        assert tokens(model, params=params) == [r[:max_tokens] for r in reference]
    # A stop token inside the accepted drafts ends the request there.
    stop = reference[3][5]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, stop_token_ids=[stop], logprobs=2)
    out = model.generate([PROMPTS[3]], params, use_tqdm=False)[0]
    first = reference[3].index(stop)
    assert out.token_ids == reference[3][:first + 1] and out.finish_reason == "stop"
    assert [lp.token_id for lp in out.logprobs] == out.token_ids


def test_logprobs_of_accepted_tokens_match(llama_dir: Path, reference: list[list[int]], monkeypatch) -> None:
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=3)
    plain = llm(llama_dir).generate(PROMPTS, params, use_tqdm=False)
    monkeypatch.setattr(speculator_module, "propose_ngram",
                        _oracle({tuple(p): r for p, r in zip(PROMPTS, reference)}, wrong=False))
    spec = llm(llama_dir, 3).generate(PROMPTS, params, use_tqdm=False)
    for a, b in zip(plain, spec):
        assert a.token_ids == b.token_ids
        assert len(b.logprobs) == len(b.token_ids)
        for x, y in zip(a.logprobs, b.logprobs):
            assert x.token_id == y.token_id and abs(x.logprob - y.logprob) < 1e-4
            assert [t for t, _ in x.top] == [t for t, _ in y.top]


def test_config_is_validated() -> None:
    with pytest.raises(ValueError, match="num_speculative_tokens is required"):
        EngineConfig(model="m", speculative_config={"method": "ngram"})
    with pytest.raises(ValueError, match="unknown key"):
        EngineConfig(model="m", speculative_config={"num_speculative_tokens": 2, "lookahead": 3})
    with pytest.raises(ValueError, match="method must be one of"):
        SpeculativeConfig(num_speculative_tokens=2, method="eagle")
    with pytest.raises(ValueError, match="prompt_lookup_max"):
        SpeculativeConfig(num_speculative_tokens=2, prompt_lookup_min=4, prompt_lookup_max=2)
    with pytest.raises(ValueError, match="num_speculative_tokens must be in"):
        SpeculativeConfig(num_speculative_tokens=0)
    with pytest.raises(ValueError, match="needs model"):
        SpeculativeConfig(num_speculative_tokens=2, method="draft_model")
    assert SpeculativeConfig(num_speculative_tokens=2, model="/d").method == "draft_model"
    assert EngineConfig(model="m", speculative_config={"num_speculative_tokens": 3}).speculative_config.method == "ngram"


def test_cuda_graphs_take_verify_steps() -> None:
    """Which steps replay a CUDA graph (a row per token); the replay itself needs a GPU
    (benchmarks/gpu_check.py)."""
    import numpy as np

    from engine.cuda_graphs import CudaGraphRunner
    from engine.runner import StepInputs

    graphs = object.__new__(CudaGraphRunner)
    graphs.buckets, graphs.max_context = [1, 2, 4, 8], 64

    def step(query_lens: list[int], seq_lens: list[int], sampled: int, drafts: bool = True) -> StepInputs:
        tokens = sum(query_lens)
        num_drafts = np.array([q - 1 for q in query_lens] if drafts and max(query_lens) > 1 else [], np.int32)
        return StepInputs(np.zeros(tokens, np.int64), np.zeros(tokens, np.int64), np.zeros(tokens, np.int64),
                          np.zeros(len(query_lens) + 1, np.int32), np.array(seq_lens, np.int32),
                          np.zeros((len(query_lens), 4), np.int32), np.arange(sampled), query_lens,
                          num_drafts=num_drafts)

    assert graphs.can_run(step([1, 1], [9, 30], 2))  # decode
    assert graphs.can_run(step([4, 1, 3], [20, 9, 30], 8))  # verify: a token and its drafts, every one sampled
    assert not graphs.can_run(step([4, 1], [20, 9], 2, drafts=False))  # a prompt chunk samples one row
    assert not graphs.can_run(step([4, 1], [20, 9], 5, drafts=False))  # prompt logprobs: no drafts
    assert not graphs.can_run(step([4, 4, 2], [20, 20, 30], 10))  # more tokens than the largest graph
    assert not graphs.can_run(step([2], [65], 2))  # past the graphs' context


@pytest.mark.parametrize("bad", ["a", "b"])
def test_unusable_logits_fail_the_request_whose_row_they_are(llama_dir: Path, monkeypatch, bad: str) -> None:
    """A request with d drafts has d + 1 sampler rows: a bad row is mapped to its
    request, not read as one row per request (which named another request, or ran off
    the list and took the engine down)."""
    from engine.engine_core import EngineCore
    from engine.errors import RequestsFailed

    monkeypatch.setattr(speculator_module, "propose_ngram", lambda seq, room, *_: [5] * room if seq[0] == 7 else [])
    core = EngineCore(EngineConfig(model=str(llama_dir), num_kv_blocks=64,
                                   speculative_config={"num_speculative_tokens": 4}))
    core.add_request("a", [7, 8, 9, 7, 8], GREEDY)
    core.add_request("b", [3, 4, 3, 4, 3], GREEDY)
    core.step()
    original = core.runner.sampler.sample

    def sample(logits, rows, drafts=None):
        assert drafts is not None and len(rows) == 6  # a: 4 drafts + 1, b: 1
        logits = logits.clone()
        logits[0 if bad == "a" else 5] = float("nan")
        return original(logits, rows, drafts)

    monkeypatch.setattr(core.runner.sampler, "sample", sample)
    with pytest.raises(RequestsFailed) as failed:
        core.step()
    assert failed.value.request_ids == [bad]
    core.close()


def test_cuda_graph_inputs_of_every_step(llama_dir: Path, monkeypatch) -> None:
    """The graph runner's input copies for each step a speculating engine makes (the
    replay itself needs a GPU): a request holding blocks past its context (rejected
    drafts' slots) still fits the graphs' block tables, and a verify step gets a row
    per token, each over the context up to its token."""
    import numpy as np
    import torch

    from engine import cuda_graphs
    from engine.engine_core import EngineCore
    from engine.runner import build_step_inputs

    block, context = 8, 32
    monkeypatch.setattr(cuda_graphs, "MAX_CONTEXT", context)
    # Wrong drafts once, at 30 tokens: slots up to 33 are taken (5 blocks), then the context is back at 31.
    monkeypatch.setattr(speculator_module, "propose_ngram", lambda seq, room, *_: [5] * room if len(seq) in (22, 30) else [])
    core = EngineCore(EngineConfig(model=str(llama_dir), num_kv_blocks=64, block_size=block, max_model_len=128,
                                   enable_prefix_caching=False, speculative_config={"num_speculative_tokens": 4}))
    graphs = object.__new__(cuda_graphs.CudaGraphRunner)  # buffers only: no capture without a GPU
    graphs.buckets, graphs.max_context, graphs.device = cuda_graphs.batch_buckets(8, 40), context, torch.device("cpu")
    n = graphs.buckets[-1]
    graphs.input_ids, graphs.positions = torch.zeros(n, dtype=torch.int64), torch.zeros(n, dtype=torch.int64)
    graphs.slot_mapping, graphs.seq_lens = torch.full((n,), -1), torch.ones(n, dtype=torch.int32)
    graphs.block_tables = torch.zeros((n, context // block), dtype=torch.int32)
    graphs.logits = torch.arange(n, dtype=torch.float32)[:, None].repeat(1, 3)  # row i holds i

    class Replay:
        def replay(self) -> None:
            pass

    graphs.graphs = {size: Replay() for size in graphs.buckets}
    replayed = []
    launch = core.runner.launch

    def checked(scheduled, block_tables, *args, **kwargs):
        inputs = build_step_inputs(scheduled, block_tables, block)
        if graphs.can_run(inputs):
            logits = graphs.run(inputs, core.runner.upload(inputs))
            b = len(inputs.input_ids)
            assert logits[:, 0].tolist() == list(range(b)) == inputs.logits_indices.tolist()
            assert graphs.seq_lens[:b].tolist() == (inputs.positions + 1).tolist()
            rows = np.repeat(np.arange(len(inputs.query_lens)), inputs.query_lens)
            width = min(graphs.block_tables.shape[1], block_tables.shape[1])
            assert (graphs.block_tables[:b, :width].numpy() == block_tables[rows, :width]).all()
            replayed.append(b)
        return launch(scheduled, block_tables, *args, **kwargs)

    monkeypatch.setattr(core.runner, "launch", checked)
    core.add_request("r", list(range(10, 30)), SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))
    while core.has_unfinished():
        core.step()
    core.close()
    assert 5 in replayed and 1 in replayed  # verify steps (a token and 4 drafts) and decode steps


def test_seeded_sampling_does_not_depend_on_the_batch(llama_dir: Path, monkeypatch) -> None:
    """How many rows a request's steps have depends on its drafts and on the others
    (budget, free blocks); a seeded request's draws are keyed on its position, so it
    gives the same tokens alone and in a crowded batch, and choice i of n equals a
    single request seeded seed + i."""
    monkeypatch.setattr(speculator_module, "propose_ngram", lambda seq, room, *_: ([seq[-1], seq[-2]] * room)[:room])
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1}
    seeded = SamplingParams(max_tokens=32, temperature=0.8, seed=1234, ignore_eos=True)
    alone = LLM(str(llama_dir), num_kv_blocks=64, speculative_config=spec)
    crowded = LLM(str(llama_dir), num_kv_blocks=64, max_num_batched_tokens=8, speculative_config=spec)
    first = alone.generate([PROMPTS[3]], seeded, use_tqdm=False)[0].token_ids
    others = [PROMPTS[4], [20, 21, 22] * 8, [30, 31] * 10]
    outs = crowded.generate([PROMPTS[3], *others], [seeded] + [GREEDY] * 3, use_tqdm=False)
    assert outs[0].token_ids == first
    assert alone.core.speculator.stats.num_draft_tokens > 0 and crowded.core.speculator.stats.num_draft_tokens > 0
    group = crowded.generate([PROMPTS[3]], SamplingParams(n=3, max_tokens=24, temperature=0.8, seed=77,
                                                          ignore_eos=True), use_tqdm=False)[0]
    for i, choice in enumerate(group.sequences):
        single = SamplingParams(max_tokens=24, temperature=0.8, seed=77 + i, ignore_eos=True)
        assert choice.token_ids == alone.generate([PROMPTS[3]], single, use_tqdm=False)[0].token_ids
