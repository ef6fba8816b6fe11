"""User-facing behaviour of the offline API: LLM(model_dir, **options).generate() / .chat().

Tiny seeded Llama (tests/tiny_models.py), CPU, short generations. Each test asserts
something a user would notice: errors that name the problem and leave the engine
usable, reproducible seeds, stop conditions, penalties, logprobs, chat templates,
priorities, and aborts that give every KV block back.
"""

from __future__ import annotations

import math
import re
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from engine.request import RequestStatus

PROMPTS = ["The quick brown fox", "What is the capital of France?", "Paged attention stores"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12)
VOCAB = 384  # tests/tiny_models.VOCAB_SIZE
# A prompt whose un-penalised greedy continuation repeats heavily (checked in the test).
REPEATING_PROMPT = "What is the capital of France?"


def make_llm(model_dir: str, **options) -> LLM:
    # One intra-op thread: far faster than the default for a model this small on CPU.
    options.setdefault("num_threads", 1)
    return LLM(model_dir, **options)


@pytest.fixture(scope="module", autouse=True)
def _restore_torch_threads():
    """num_threads sets a process-wide torch setting; give other test modules theirs back."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def run(llm: LLM, prompts, params=GREEDY, **kw):
    return llm.generate(prompts, params, use_tqdm=False, **kw)


def assert_clean(llm: LLM) -> None:
    """No request left behind, every KV block back in the free queue, no negative ref count."""
    kv = llm.core.kv
    assert not llm.core.has_unfinished()
    assert kv.num_free_blocks == kv.pool.num_blocks
    assert all(b.ref_cnt >= 0 for b in kv.pool.blocks)
    assert all(b.ref_cnt == 0 for b in kv.pool.blocks)


def summary(outputs) -> list[tuple[list[int], str, str | None]]:
    return [(o.token_ids, o.text, o.finish_reason) for o in outputs]


def assert_still_works(llm: LLM, reference) -> None:
    """The engine is clean, generates exactly what a fresh engine does, and is clean after."""
    assert_clean(llm)
    outputs = run(llm, PROMPTS)
    assert [o.prompt for o in outputs] == PROMPTS
    assert summary(outputs) == reference
    assert_clean(llm)


@pytest.fixture(scope="module")
def reference(llama_dir: Path):
    """What a brand-new engine generates for PROMPTS with GREEDY."""
    outputs = run(make_llm(str(llama_dir), num_kv_blocks=128), PROMPTS)
    assert all(len(o.token_ids) == GREEDY.max_tokens for o in outputs)
    assert len({tuple(o.token_ids) for o in outputs}) == len(PROMPTS)  # prompts really differ
    return summary(outputs)


@pytest.fixture(scope="module")
def llm(llama_dir: Path) -> LLM:
    return make_llm(str(llama_dir), num_kv_blocks=128)


@pytest.fixture(scope="module")
def small_ctx(llama_dir: Path) -> LLM:
    return make_llm(str(llama_dir), num_kv_blocks=32, max_model_len=64)


@pytest.fixture(scope="module")
def no_tokenizer_dir(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same weights without any tokenizer files."""
    out = tmp_path_factory.mktemp("no_tokenizer")
    for name in ("config.json", "model.safetensors", "generation_config.json"):
        if (llama_dir / name).is_file():
            shutil.copy(llama_dir / name, out / name)
    return out


# --- 1. bad input: ValueError naming the problem, engine unharmed -------------------------

BAD_INPUTS: dict[str, tuple[Callable[[LLM], object], str]] = {
    "empty string prompt": (lambda m: run(m, ""), r"empty"),
    "empty string in batch": (lambda m: run(m, [PROMPTS[0], ""]), r"empty"),
    "empty token list": (lambda m: run(m, [[]]), r"at least one token"),
    "token id out of vocab": (lambda m: run(m, [[5, 6, VOCAB]]), r"token ids.*\[0, 384\)"),
    "negative token id": (lambda m: run(m, [[5, -1, 6]]), r"token ids"),
    "max_tokens=0": (lambda m: run(m, PROMPTS[0], SamplingParams(max_tokens=0)), r"max_tokens"),
    "top_p=0": (lambda m: run(m, PROMPTS[0], SamplingParams(top_p=0.0)), r"top_p"),
    "top_p=1.5": (lambda m: run(m, PROMPTS[0], SamplingParams(top_p=1.5)), r"top_p"),
    "temperature=-1": (lambda m: run(m, PROMPTS[0], SamplingParams(temperature=-1.0)),
                       r"temperature"),
    "min_tokens > max_tokens": (lambda m: run(m, PROMPTS[0], SamplingParams(max_tokens=2, min_tokens=3)),
                                r"min_tokens"),
    "params list length mismatch": (lambda m: run(m, PROMPTS, [GREEDY, GREEDY]),
                                    r"2 SamplingParams for 3 prompts"),
    "bad prompt type": (lambda m: run(m, [PROMPTS[0], 3.5]), r"string or a list of token ids"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_is_value_error_and_engine_stays_usable(llm: LLM, reference, case: str):
    call, message = BAD_INPUTS[case]
    with pytest.raises(ValueError, match=message):
        call(llm)
    assert_still_works(llm, reference)


def test_prompt_longer_than_context(small_ctx: LLM, reference):
    for n in (64, 100):
        with pytest.raises(ValueError, match=r"context length is 64"):
            run(small_ctx, [[7] * n])
    assert_still_works(small_ctx, reference)


def test_prompt_plus_max_tokens_over_context(small_ctx: LLM, reference):
    prompt = list(range(10, 50))  # 40 tokens
    with pytest.raises(ValueError, match=r"40 \+ max_tokens \(30\)|exceeds the model's context"):
        run(small_ctx, [prompt], SamplingParams(max_tokens=30))
    assert_still_works(small_ctx, reference)
    # Exactly filling the context is allowed, and stops there.
    out = run(small_ctx, [prompt], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))[0]
    assert len(out.token_ids) == 24 and out.finish_reason == "length"
    assert_clean(small_ctx)


def test_max_model_len_above_model_limit_is_rejected(llama_dir: Path):
    with pytest.raises(ValueError, match=r"max_model_len 4096 exceeds"):
        make_llm(str(llama_dir), num_kv_blocks=8, max_model_len=4096)


def test_unknown_option_is_named(llama_dir: Path):
    with pytest.raises(ValueError, match="bogus_option"):
        LLM(str(llama_dir), bogus_option=1)


def test_bad_prompt_in_batch_runs_nothing(llm: LLM, reference):
    # The bad prompt comes last, so the good ones ahead of it are already queued when the
    # engine rejects it; they must be withdrawn before computing anything.
    probe = list(range(100, 140))  # 40 tokens: two full KV blocks a later run could reuse
    with pytest.raises(ValueError, match=r"token ids"):
        run(llm, [probe, PROMPTS[0], [1, 2, 10_000]])
    assert_clean(llm)
    # Had the probe's prompt been computed, its blocks would now be prefix-cache hits.
    first = run(llm, [probe])[0]
    assert first.num_cached_tokens == 0
    assert run(llm, [probe])[0].num_cached_tokens == 32  # the probe can detect a computed prompt
    # A too-long prompt in a batch is rejected before anything is queued.
    with pytest.raises(ValueError, match=r"exceeds the model's context|context length"):
        run(llm, [PROMPTS[0], [5] * 1100])
    assert_still_works(llm, reference)


def test_priority_length_mismatch_is_value_error(llm: LLM, reference):
    with pytest.raises(ValueError, match="priorit"):
        run(llm, PROMPTS, priority=[0])  # zip() would silently drop two prompts
    assert_still_works(llm, reference)


def test_model_without_tokenizer(no_tokenizer_dir: Path):
    llm = make_llm(str(no_tokenizer_dir), num_kv_blocks=16)
    with pytest.raises(ValueError, match="tokenizer"):
        run(llm, "hello")
    with pytest.raises(ValueError, match="chat template"):
        llm.chat([{"role": "user", "content": "hi"}], GREEDY, use_tqdm=False)
    assert_clean(llm)
    out = run(llm, [[5, 6, 7]])[0]
    assert len(out.token_ids) == GREEDY.max_tokens and out.text == ""
    assert_clean(llm)


def test_stop_strings_without_tokenizer_leave_engine_usable(no_tokenizer_dir: Path):
    llm = make_llm(str(no_tokenizer_dir), num_kv_blocks=16)
    expected = run(llm, [[5, 6, 7]])[0].token_ids
    with pytest.raises(ValueError, match="stop strings need a tokenizer"):
        run(llm, [[5, 6, 7]], SamplingParams(stop=["x"], max_tokens=4))
    assert_clean(llm)
    assert run(llm, [[5, 6, 7]])[0].token_ids == expected


# --- 2. seeded sampling ------------------------------------------------------------------

def test_seeded_sampling_reproducible_alone_and_in_batches(llm: LLM):
    prompt = PROMPTS[0]
    seeded = SamplingParams(temperature=1.0, seed=1234, max_tokens=12, ignore_eos=True)
    alone = run(llm, prompt, seeded)[0].token_ids
    assert run(llm, prompt, seeded)[0].token_ids == alone
    unseeded = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    other_seed = SamplingParams(temperature=0.8, top_k=20, seed=7, max_tokens=20, ignore_eos=True)
    batches = [
        ([PROMPTS[1], prompt, PROMPTS[2]], [unseeded, seeded, other_seed], 1),
        ([prompt, PROMPTS[2]], [seeded, unseeded], 0),
        ([PROMPTS[2], PROMPTS[1], PROMPTS[0], prompt], [other_seed, unseeded, GREEDY, seeded], 3),
    ]
    for prompts, params, pos in batches:
        outputs = run(llm, prompts, params)
        assert outputs[pos].token_ids == alone, f"seeded request at position {pos} changed"
    # The same seed twice in one batch: both draw the same stream.
    twice = run(llm, [prompt, prompt], [seeded, seeded])
    assert twice[0].token_ids == twice[1].token_ids == alone
    # It really is sampling: temperature 1 differs from greedy.
    assert alone != run(llm, prompt, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))[0].token_ids
    assert_clean(llm)


def test_different_seeds_give_different_outputs(llm: LLM):
    outputs = run(llm, [PROMPTS[0]] * 5,
                  [SamplingParams(temperature=1.0, seed=s, max_tokens=8, ignore_eos=True) for s in range(5)])
    assert len({tuple(o.token_ids) for o in outputs}) >= 2
    assert_clean(llm)


# --- 3. stop conditions ------------------------------------------------------------------

def pick_stop_string(text: str) -> tuple[str, int] | None:
    """An ASCII-letter substring whose first occurrence sits well inside `text`."""
    for m in re.finditer(r"[A-Za-z]{2,3}", text):
        s = m.group()
        if m.start() >= 3 and m.end() <= len(text) - 3 and text.find(s) == m.start():
            return s, m.start()
    return None


def test_stop_string_truncates_text(llm: LLM):
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    checked = 0
    for prompt in PROMPTS:
        base = run(llm, prompt, params)[0]
        picked = pick_stop_string(base.text)
        if picked is None:
            continue
        stop, at = picked
        out = run(llm, prompt, SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True,
                                              stop=[stop]))[0]
        assert out.finish_reason == "stop"
        assert out.text == base.text[:at]
        assert stop not in out.text
        assert len(out.token_ids) < len(base.token_ids)
        assert out.token_ids == base.token_ids[:len(out.token_ids)]
        kept = run(llm, prompt, SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True,
                                               stop=[stop], include_stop_str_in_output=True))[0]
        assert kept.finish_reason == "stop"
        assert kept.text == base.text[:at + len(stop)]
        # Several stop strings: the earliest one in the text wins, whatever the list order.
        later = base.text[-3:]
        if base.text.find(later) > at:
            both = run(llm, prompt, SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True,
                                                   stop=[later, stop]))[0]
            assert both.text == base.text[:at] and both.finish_reason == "stop"
        checked += 1
    assert checked >= 2
    assert_clean(llm)


def test_stop_token_ids(llm: LLM):
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    bases = [run(llm, p, params)[0] for p in PROMPTS]
    prompt, base = next((p, b) for p, b in zip(PROMPTS, bases) if len(set(b.token_ids[:3])) == 3)
    stop = base.token_ids[2]
    out = run(llm, prompt, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True,
                                          stop_token_ids=[stop]))[0]
    assert out.finish_reason == "stop"
    assert out.token_ids == base.token_ids[:3]
    assert out.token_ids[-1] == stop
    assert_clean(llm)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_max_tokens_gives_length(llm: LLM, temperature: float):
    outputs = run(llm, PROMPTS, SamplingParams(temperature=temperature, seed=3, max_tokens=7,
                                               ignore_eos=True))
    for o in outputs:
        assert len(o.token_ids) == 7
        assert o.finish_reason == "length"
        assert o.text
    assert_clean(llm)


def test_min_tokens_defers_stop_token(llm: LLM):
    prompt = PROMPTS[1]
    first = run(llm, prompt, SamplingParams(temperature=0.0, max_tokens=10))[0].token_ids[0]
    # Control: without min_tokens, the first token already stops the request.
    control = run(llm, prompt, SamplingParams(temperature=0.0, max_tokens=10, stop_token_ids=[first]))[0]
    assert control.token_ids == [first] and control.finish_reason == "stop"
    out = run(llm, prompt, SamplingParams(temperature=0.0, max_tokens=10, min_tokens=6,
                                          stop_token_ids=[first]))[0]
    assert len(out.token_ids) >= 6
    assert first not in out.token_ids[:6]
    if out.finish_reason == "stop":
        assert out.token_ids[-1] == first
    else:
        assert out.finish_reason == "length" and len(out.token_ids) == 10
    assert_clean(llm)


def test_min_tokens_defers_stop_string(llm: LLM):
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    prompt, base, stop, at = next((p, b, *s) for p in PROMPTS
                                  for b in [run(llm, p, params)[0]]
                                  for s in [pick_stop_string(b.text)] if s is not None)
    early = run(llm, prompt, SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True,
                                            stop=[stop]))[0]
    min_tokens = len(early.token_ids) + 5
    out = run(llm, prompt, SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True,
                                          stop=[stop], min_tokens=min_tokens))[0]
    assert len(out.token_ids) >= min_tokens


# --- 4. penalties ------------------------------------------------------------------------

def num_repeats(token_ids: list[int]) -> int:
    return len(token_ids) - len(set(token_ids))


@pytest.mark.parametrize("penalty", [{"repetition_penalty": 2.0}, {"frequency_penalty": 2.0},
                                     {"presence_penalty": 2.0}])
def test_penalties_reduce_repetition(llm: LLM, penalty: dict):
    base = run(llm, REPEATING_PROMPT, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))[0]
    assert len(base.token_ids) == 40
    assert num_repeats(base.token_ids) >= 5, "baseline must repeat for this test to mean anything"
    out = run(llm, REPEATING_PROMPT, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True,
                                                    **penalty))[0]
    assert len(out.token_ids) == 40
    assert num_repeats(out.token_ids) < num_repeats(base.token_ids)
    assert_clean(llm)


# --- 5. logprobs -------------------------------------------------------------------------

def check_logprobs(out, k: int) -> None:
    assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids)
    for token_id, lp in zip(out.token_ids, out.logprobs):
        assert lp.token_id == token_id
        assert lp.logprob <= 0.0
        assert len(lp.top) == k
        values = [v for _, v in lp.top]
        assert values == sorted(values, reverse=True)
        assert all(v <= 0.0 for v in values)
        assert sum(math.exp(v) for v in values) <= 1.0 + 1e-5
        assert not values or lp.logprob <= values[0] + 1e-6
        for t, v in lp.top:
            if t == token_id:
                assert lp.logprob == pytest.approx(v, abs=1e-5)


def test_logprobs_greedy(llm: LLM):
    plain = run(llm, PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=8))[0]
    assert plain.logprobs is None
    out = run(llm, PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=8, logprobs=3))[0]
    assert out.token_ids == plain.token_ids  # asking for logprobs changes nothing
    check_logprobs(out, 3)
    for lp in out.logprobs:
        assert lp.top[0][0] == lp.token_id
        assert lp.logprob == pytest.approx(lp.top[0][1], abs=1e-6)
    assert_clean(llm)


def test_logprobs_sampled_and_mixed_batch(llm: LLM):
    params = [SamplingParams(temperature=1.0, seed=11, max_tokens=8, logprobs=3, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=8),
              SamplingParams(temperature=0.0, max_tokens=8, logprobs=0)]
    sampled, plain, zero = run(llm, PROMPTS, params)
    check_logprobs(sampled, 3)
    assert plain.logprobs is None
    check_logprobs(zero, 0)
    assert_clean(llm)


# --- 6. chat -----------------------------------------------------------------------------

def template_ids(tokenizer, messages) -> list[int]:
    rendered = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    return list(rendered["input_ids"] if isinstance(rendered, Mapping) else rendered)


def test_chat(llm: LLM):
    tok = llm.tokenizer
    conv1 = [{"role": "user", "content": "What is the capital of France?"}]
    conv2 = [{"role": "system", "content": "Be brief."},
             {"role": "user", "content": "Paged attention stores keys"}]
    out = llm.chat(conv1, GREEDY, use_tqdm=False)
    assert len(out) == 1
    out = out[0]
    expected = template_ids(tok, conv1)
    assert out.prompt_token_ids[:len(expected)] == expected
    assert out.prompt_token_ids == expected
    assert out.prompt == tok.apply_chat_template(conv1, tokenize=False, add_generation_prompt=True)
    assert out.prompt_token_ids[0] == tok.bos_token_id and out.prompt_token_ids[1] != tok.bos_token_id
    assert isinstance(out.text, str) and out.text
    assert len(out.token_ids) == GREEDY.max_tokens
    # Same as generating from the rendered prompt's token ids.
    assert run(llm, [out.prompt_token_ids])[0].token_ids == out.token_ids
    # A batch of conversations: one output each, in order.
    both = llm.chat([conv1, conv2], GREEDY, use_tqdm=False)
    assert [o.prompt_token_ids for o in both] == [expected, template_ids(tok, conv2)]
    assert both[0].token_ids == out.token_ids
    assert both[1].token_ids != out.token_ids
    assert_clean(llm)


# --- 7. priority -------------------------------------------------------------------------

def test_priority_keeps_prompt_order(llm: LLM, reference):
    outputs = run(llm, PROMPTS, priority=[2, 0, 1])
    assert [o.prompt for o in outputs] == PROMPTS
    assert summary(outputs) == reference
    assert_clean(llm)


@pytest.mark.parametrize("priority,first", [([2, 0, 1], 1), ([0, 1, 2], 0), ([1, 2, 0], 2)])
def test_priority_decides_who_runs_first(llama_dir: Path, llm: LLM, priority, first):
    # One sequence at a time, prompts sharing two full blocks: only the request that runs
    # first computes the shared prefix; the others find it in the prefix cache.
    serial = make_llm(str(llama_dir), num_kv_blocks=32, max_num_seqs=1)
    prefix = list(range(20, 52))
    prompts = [prefix + [200 + 10 * i, 201 + 10 * i] for i in range(3)]
    outputs = run(serial, prompts, SamplingParams(temperature=0.0, max_tokens=4), priority=priority)
    assert [o.prompt_token_ids for o in outputs] == prompts
    assert [o.num_cached_tokens for o in outputs] == [0 if i == first else 32 for i in range(3)]
    alone = run(llm, prompts, SamplingParams(temperature=0.0, max_tokens=4))
    assert [o.token_ids for o in outputs] == [o.token_ids for o in alone]
    assert_clean(serial)


# --- 8. abort ----------------------------------------------------------------------------

def assert_ref_counts_ok(llm: LLM) -> None:
    assert all(b.ref_cnt >= 0 for b in llm.core.kv.pool.blocks)


def test_abort_frees_blocks(llama_dir: Path, reference):
    llm = make_llm(str(llama_dir), num_kv_blocks=32)
    core, kv = llm.core, llm.core.kv
    params = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)
    ids_a, ids_b = list(range(10, 30)), list(range(40, 55))
    a = core.add_request("a", ids_a, params)
    b = core.add_request("b", ids_b, params)
    for _ in range(3):
        core.step()
        assert_ref_counts_ok(llm)
    assert a.num_output_tokens == 3 and kv.block_ids("a")
    free_before = kv.num_free_blocks
    assert core.abort(["a"]) == [a]
    assert a.status == RequestStatus.FINISHED_ABORTED
    assert kv.block_ids("a") == []
    assert kv.num_free_blocks > free_before
    assert_ref_counts_ok(llm)
    # A request aborted while still waiting holds nothing and never runs.
    c = core.add_request("c", list(range(60, 70)), params)
    assert core.abort(["c"]) == [c] and c.status == RequestStatus.FINISHED_ABORTED
    # Unknown or already-finished ids are ignored.
    assert core.abort(["a", "nope"]) == []
    finished = []
    while core.has_unfinished():
        step = core.step()
        assert a not in step.advanced and c not in step.advanced
        finished += step.finished
        assert_ref_counts_ok(llm)
    assert finished == [b]
    assert b.status == RequestStatus.FINISHED_LENGTH and b.num_output_tokens == 50
    assert a.num_output_tokens == 3 and c.num_output_tokens == 0
    assert kv.num_free_blocks == kv.pool.num_blocks
    # The survivor generated exactly what it generates alone.
    assert run(llm, [ids_b], params)[0].token_ids == b.output_token_ids
    assert_still_works(llm, reference)


def test_abort_preempted_and_running_requests(llama_dir: Path, reference):
    # 8 blocks of 16 tokens: two 66-token requests (5 blocks each) can't both stay resident.
    llm = make_llm(str(llama_dir), num_kv_blocks=8)
    core, kv = llm.core, llm.core.kv
    params = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)
    reqs = {rid: core.add_request(rid, list(range(s, s + 16)), params)
            for rid, s in (("x", 10), ("y", 40), ("z", 70))}
    for _ in range(200):
        core.step()
        assert_ref_counts_ok(llm)
        if core.scheduler.num_preemptions and any(
                r.status == RequestStatus.PREEMPTED for r in reqs.values()):
            break
    preempted = [r for r in reqs.values() if r.status == RequestStatus.PREEMPTED]
    running = [r for r in reqs.values() if r.status == RequestStatus.RUNNING]
    assert preempted and running
    aborted = core.abort([preempted[0].request_id, running[0].request_id])
    assert {r.request_id for r in aborted} == {preempted[0].request_id, running[0].request_id}
    assert all(r.status == RequestStatus.FINISHED_ABORTED for r in aborted)
    assert_ref_counts_ok(llm)
    while core.has_unfinished():
        core.step()
        assert_ref_counts_ok(llm)
    survivors = [r for r in reqs.values() if r not in aborted]
    assert all(r.status == RequestStatus.FINISHED_LENGTH and r.num_output_tokens == 50
               for r in survivors)
    assert kv.num_free_blocks == kv.pool.num_blocks
    assert_still_works(llm, reference)
