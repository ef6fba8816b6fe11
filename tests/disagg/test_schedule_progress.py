"""Issue 23's reproductions of a stuck or crashing scheduler, end to end: a decode and
a prefill engine core over a real transport (shm, tcp), and the offline engine, with
the colocated engine's greedy tokens as the oracle."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from decode_worker.remote_kv import DecodeWorkerCore
from engine import LLM, SamplingParams
from prefill_worker.remote_prefill import PrefillWorkerCore
from tests.disagg.test_remote_prefill import GREEDY, settle_fences, worker_pair
from tests.fidelity.test_hf_fidelity import random_prompts


def oracle(model_dir: Path, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    llm = LLM(str(model_dir), num_kv_blocks=200)
    return [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def finish(decode: DecodeWorkerCore, prefill: PrefillWorkerCore, want: int, timeout_s: float = 40.0,
           before_step=lambda: None) -> dict[str, list[int]]:
    out, end = {}, time.monotonic() + timeout_s
    while len(out) < want:
        assert time.monotonic() < end, f"hung: finished only {sorted(out)}"
        before_step()
        prefill.step()
        out.update((r.request_id, r.output_token_ids) for r in decode.step().finished)
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_local_fallback_after_a_prefix_hit(llama_dir: Path, transport: str) -> None:
    """Finding 1: two concurrent remote requests share a prompt the decode cache did not
    hold; A's KV arrives (and is cached); B's remote prefill fails. B prefills locally,
    in new blocks from A's cached prefix (its reserved ones stay fenced until the
    prefill worker confirms): it crashed the decode worker (an assert), or under -O
    decoded from never-written blocks."""
    prompt = random_prompts([40], seed=11)[0]
    expected = oracle(llama_dir, [prompt], GREEDY)[0]
    decode, prefill = worker_pair(llama_dir, transport, grace_s=0.5)
    try:
        rp_a = decode.add_request("A", prompt, GREEDY, remote=True, sender="prefill")
        assert decode.add_request("B", prompt, GREEDY, remote=True, sender="prefill") is not None  # message lost
        prefill.submit(rp_a)

        def fail_b_once_a_arrived() -> None:
            if "A" not in decode.waiting_for_kv and "B" in decode.waiting_for_kv:
                decode.prefill_failed("B")
        assert finish(decode, prefill, 2, before_step=fail_b_once_a_arrived) == {"A": expected, "B": expected}
        assert decode.stats["fallbacks"] == 1
        settle_fences(decode, prefill)  # B's reserved blocks, until the prefill worker confirms
        assert decode.engine.kv.num_free_blocks == decode.engine.kv.pool.num_blocks
    finally:
        decode.transport.close()
        prefill.transport.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_a_request_whose_kv_arrived_is_not_stuck_behind_a_preempted_one(llama_dir: Path, transport: str) -> None:
    """Finding 2: a remote request holds its reserved blocks while a local one preempts
    itself; when the KV arrives the ready request must run, or the decode worker
    stepped forever with nothing finishing and still answered health pings."""
    p0, p1 = random_prompts([60, 40], seed=5)
    long = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    expected = oracle(llama_dir, [p0, p1], long)
    decode, prefill = worker_pair(llama_dir, transport, decode_blocks=8)
    try:
        assert decode.add_request("r0", p0, long, remote=False) is None
        decode.step()  # r0 prefilled: 4 of the 8 blocks
        rp1 = decode.add_request("r1", p1, GREEDY, remote=True)  # 3 blocks, waiting for its KV
        assert rp1 is not None

        def submit_once_r0_preempted() -> None:  # the prefill worker is slower than r0's decode
            if decode.engine.scheduler.num_preemptions and rp1.request_id not in prefill.jobs \
                    and "r1" in decode.waiting_for_kv:
                prefill.submit(rp1)
        out = finish(decode, prefill, 2, before_step=submit_once_r0_preempted)
        assert decode.engine.scheduler.num_preemptions > 0, "no preemption: the test tests nothing"
        assert out == {"r0": expected[0], "r1": expected[1][:10]}
    finally:
        decode.transport.close()
        prefill.transport.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_preempted_request_comes_back_with_chunked_prefill_off(llama_dir: Path, async_scheduling: bool) -> None:
    """Finding 4: with chunked prefill off, a preempted request's recompute (prompt plus
    outputs) exceeds max_num_batched_tokens; generate() spun forever."""
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompts = [[5, 6, 7, 8], [9, 10, 11, 12]]
    llm = LLM(str(llama_dir), block_size=8, max_num_batched_tokens=8, num_kv_blocks=2, enable_prefix_caching=False,
              enable_chunked_prefill=False, async_scheduling=async_scheduling)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.core.scheduler.num_preemptions > 0, "no preemption: the test tests nothing"
    assert [o.token_ids for o in outputs] == oracle(llama_dir, prompts, params)
