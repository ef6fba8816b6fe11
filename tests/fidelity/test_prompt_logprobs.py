"""Prompt logprobs (SamplingParams.prompt_logprobs) from the offline engine equal HF
transformers' float32 log-softmax over the prompt: whole, chunked over several steps,
after a prefix-cache hit was possible, and through preemptions."""

from __future__ import annotations

import pytest
import torch

from cluster.demo_model import DEMO_MODELS, default_models_dir
from engine import LLM, SamplingParams

MODEL_DIR = default_models_dir() / DEMO_MODELS["smollm2"].dir_name

pytestmark = pytest.mark.skipif(not (MODEL_DIR / "config.json").is_file(),
                                reason="demo model not prepared (make model)")

PROMPT = "Paged attention keeps keys and values in fixed-size blocks, so a prompt is " * 3


def hf_prompt_logprobs(prompt_ids: list[int]) -> torch.Tensor:
    """[len - 1, vocab] float32 log-softmax: row j predicts prompt token j + 1."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(MODEL_DIR, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf(torch.tensor([prompt_ids])).logits[0, :-1].float()
    return torch.log_softmax(logits, dim=-1)


@pytest.fixture(scope="module")
def llm() -> LLM:
    # Chunks of 24 tokens: the prompt (about 50) takes three steps.
    return LLM(str(MODEL_DIR), dtype="float32", max_num_batched_tokens=24, block_size=16, num_kv_blocks=64)


@pytest.fixture(scope="module")
def reference(llm: LLM) -> tuple[list[int], torch.Tensor]:
    ids = llm.tokenizer.encode(PROMPT)
    return ids, hf_prompt_logprobs(ids)


def check(entries: list, ids: list[int], ref: torch.Tensor, k: int) -> None:
    assert entries[0] is None and len(entries) == len(ids)
    for j, e in enumerate(entries[1:]):
        assert e.token_id == ids[j + 1]
        assert abs(e.logprob - ref[j, ids[j + 1]].item()) < 1e-4, j
        assert e.rank == int((ref[j] > ref[j, ids[j + 1]]).sum()) + 1 or abs(
            ref[j].sort(descending=True).values[e.rank - 1] - e.logprob) < 1e-4  # ties within rounding
        top_v, top_i = ref[j].topk(k)
        assert [t for t, _ in e.top] == top_i.tolist() or len(set(top_v.tolist())) < k
        assert len(e.top) == k and all(abs(v - r) < 1e-4 for (_, v), r in zip(e.top, top_v.tolist()))


def test_chunked_prompt_logprobs_equal_hf(llm: LLM, reference) -> None:
    ids, ref = reference
    assert len(ids) > 2 * llm.config.max_num_batched_tokens  # at least three chunks
    out = llm.generate(PROMPT, SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=3), use_tqdm=False)[0]
    check(out.prompt_logprobs, ids, ref, 3)
    assert out.logprobs is None  # only the prompt's were asked for


def test_a_cached_prompt_is_computed_again_for_its_logprobs(llm: LLM, reference) -> None:
    ids, ref = reference
    plain = SamplingParams(max_tokens=1, temperature=0.0)
    llm.generate(PROMPT, plain, use_tqdm=False)  # its blocks are in the prefix cache now
    assert llm.generate(PROMPT, plain, use_tqdm=False)[0].num_cached_tokens >= 32
    out = llm.generate(PROMPT, SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0), use_tqdm=False)[0]
    assert out.num_cached_tokens == 0  # no hit: cached positions have no logits
    check(out.prompt_logprobs, ids, ref, 0)
    assert all(e.top == [] for e in out.prompt_logprobs[1:])
    assert llm.generate(PROMPT, plain, use_tqdm=False)[0].prompt_logprobs is None


def test_preempted_requests_get_each_prompt_logprob_once(reference) -> None:
    ids, ref = reference
    # 9 blocks of 16 tokens: three ~65-token requests cannot all run, so some are
    # preempted and recompute their prompts.
    llm = LLM(str(MODEL_DIR), dtype="float32", max_num_batched_tokens=64, block_size=16, num_kv_blocks=9,
              async_scheduling=True)
    params = SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True, prompt_logprobs=1)
    outs = llm.generate([PROMPT] * 3, params, use_tqdm=False)
    assert llm.core.scheduler.num_preemptions > 0
    for out in outs:
        check(out.prompt_logprobs, ids, ref, 1)
