"""Disaggregated prefill through the engine: a prefill engine computes prompt KV and a
KV transport pushes it into a decode engine's reserved blocks. Greedy tokens must be
identical to the colocated engine's, with fallbacks when the prefill side fails."""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from decode_worker.remote_kv import DecodeWorkerCore
from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.engine_core import EngineCore
from engine.request import Request
from kv_transfer import TransportConfig, create_transport, shm
from kv_transfer.shm import ShmTransport
from prefill_worker.remote_prefill import PrefillWorkerCore
from tests.fidelity.test_hf_fidelity import random_prompts

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
SHARED = random_prompts([40], seed=7)[0]
# Mixed lengths, on and off block boundaries; two share a 40-token prefix so the second
# finds 2 blocks in the decode engine's prefix cache and gets only the rest pushed.
PROMPTS = random_prompts([2, 17, 33, 64, 90], seed=8) + [SHARED + [5, 6, 7], SHARED + list(range(9, 30))]


def worker_pair(model_dir: Path, transport: str, deadline_s: float = 30.0, grace_s: float = 5.0,
                async_scheduling: bool = False, prefill_blocks: int = 80, prefix_caching: bool = True,
                decode_blocks: int = 80, speculative_config: dict | None = None, stream: str = "chunk",
                stream_min_tokens: int = 0, stream_layers: int = 1):
    config = TransportConfig(timeout_s=5.0, cancel_grace_s=grace_s, stream=stream, stream_min_tokens=stream_min_tokens,
                             stream_layers=stream_layers)
    t_dec, t_pre = create_transport(transport, "decode", config), create_transport(transport, "prefill", config)
    dec = EngineCore(EngineConfig(model=str(model_dir), num_kv_blocks=decode_blocks, async_scheduling=async_scheduling,
                                  speculative_config=speculative_config), t_dec.allocate_kv_cache)
    # A small token budget: prompts arrive in chunks, so blocks are pushed as they fill.
    pre = EngineCore(EngineConfig(model=str(model_dir), num_kv_blocks=prefill_blocks, max_num_batched_tokens=24,
                                  async_scheduling=async_scheduling, enable_prefix_caching=prefix_caching),
                     t_pre.allocate_kv_cache)
    for t, core in ((t_dec, dec), (t_pre, pre)):
        t.register_kv_cache(core.kv_cache, "tiny-llama")
    t_pre.add_peer(t_dec.metadata())
    return DecodeWorkerCore(dec, t_dec, deadline_s), PrefillWorkerCore(pre, t_pre)


def run(decode: DecodeWorkerCore, prefill: PrefillWorkerCore | None, prompts: list[list[int]],
        timeout: float = 60.0) -> dict[str, Request]:
    """Submit in order (each after the previous finished, so prefixes are cached), step
    both workers until done; returns the finished requests."""
    outputs = {}
    for i, prompt in enumerate(prompts):
        rp = decode.add_request(f"r{i}", prompt, GREEDY, remote=True, sender="prefill")
        if rp is not None and prefill is not None:
            prefill.submit(rp)
        end = time.monotonic() + timeout
        while decode.engine.has_unfinished() or (prefill and prefill.engine.has_unfinished()):
            assert time.monotonic() < end, "disaggregated run did not finish"
            if prefill is not None:
                for result in prefill.step():
                    if result.error is not None:
                        decode.prefill_failed(result.request_id)
            for r in decode.step().finished:
                outputs[r.request_id] = r
    return outputs


def settle_fences(decode: DecodeWorkerCore, prefill: PrefillWorkerCore, timeout: float = 10.0) -> None:
    """Step both until the prefill worker has confirmed every reservation the decode
    worker gave up on (its blocks fenced meanwhile)."""
    end = time.monotonic() + timeout
    while decode.quarantined_blocks():
        assert time.monotonic() < end, f"{decode.quarantined_blocks()} blocks stay fenced"
        prefill.step()
        decode.step()


def tokens(requests: dict[str, Request]) -> dict[str, list[int]]:
    return {k: r.output_token_ids for k, r in requests.items()}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport,async_scheduling", [("shm", False), ("tcp", False), ("shm", True)])
def test_pushed_kv_gives_colocated_tokens(llama_dir: Path, reference, transport: str,
                                          async_scheduling: bool) -> None:
    decode, prefill = worker_pair(llama_dir, transport, async_scheduling=async_scheduling)
    try:
        done = run(decode, prefill, PROMPTS)
        assert tokens(done) == reference
        assert decode.stats["remote"] == len(PROMPTS) and decode.stats["fallbacks"] == 0
        assert prefill.stats["prefills"] == len(PROMPTS) and prefill.stats["failed"] == 0
        # The second shared-prefix request found the first's 2 full blocks in the decode
        # engine's prefix cache (the pushed blocks were registered there) and got only
        # the rest pushed.
        last = done[f"r{len(PROMPTS) - 1}"]
        assert last.num_cached_tokens == 32
        assert last.num_remote_tokens == len(PROMPTS[-1]) - 1 - 32
        for core in (decode.engine, prefill.engine):
            assert core.kv.num_free_blocks == core.kv.pool.num_blocks, "blocks leaked"
    finally:
        decode.transport.close()
        prefill.transport.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_dead_prefill_worker_falls_back_to_local_prefill(llama_dir: Path, reference, transport: str,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    decode, prefill = worker_pair(llama_dir, transport, deadline_s=0.3, grace_s=0.2)
    try:
        # No prefill worker steps: every reservation expires and decode prefills locally,
        # at once, in other blocks; each fallback is logged, naming the deadline.
        with caplog.at_level(logging.WARNING, logger="decode_worker.remote_kv"):
            assert tokens(run(decode, None, PROMPTS[:3])) == {k: reference[k] for k in ("r0", "r1", "r2")}
        assert decode.stats["fallbacks"] == decode.stats["remote"] > 0
        assert sum("within prefill_deadline_s (0.3 s)" in r.getMessage() for r in caplog.records) \
            == decode.stats["fallbacks"]
        fenced = decode.quarantined_blocks()
        # One-sided: the reserved blocks stay fenced while the silent prefill worker
        # lives, and come back once it answers; two-sided: at once.
        assert fenced > 0 if transport == "shm" else fenced == 0
        settle_fences(decode, prefill)
        assert decode.engine.kv.num_free_blocks == decode.engine.kv.pool.num_blocks
    finally:
        decode.transport.close()
        prefill.transport.close()


@pytest.mark.timeout(120)
def test_a_prompt_that_arrives_after_its_deadline_is_refused_not_computed(llama_dir: Path) -> None:
    """A RemotePrefill held up on the way (a partition between the hosts that healed)
    reaches the prefill worker after the decode worker gave up on it: computing it
    would only waste the prefill pool."""
    decode, prefill = worker_pair(llama_dir, "tcp", deadline_s=0.2)
    try:
        rp = decode.add_request("late", PROMPTS[1], GREEDY, remote=True)
        time.sleep(0.3)
        with pytest.raises(ValueError, match="arrived after its reservation's deadline; not computed"):
            prefill.submit(rp)
        assert not prefill.jobs and not prefill.engine.has_unfinished() and prefill.stats["refused"] == 1
    finally:
        decode.transport.close()
        prefill.transport.close()


@pytest.mark.timeout(120)
def test_a_restarted_decode_worker_never_gets_writes_meant_for_the_one_before(llama_dir: Path) -> None:
    """The decode worker dies and comes back under the same name (new cache, new
    session) while the prefill worker still has a job queued for the old one, and a
    prefill request from the old one arrives late: neither may write into the new
    worker's blocks (they are not the blocks that were reserved)."""
    old, prefill = worker_pair(llama_dir, "shm")
    new, new_prefill = worker_pair(llama_dir, "shm")
    try:
        queued = old.add_request("queued", PROMPTS[4], GREEDY, remote=True)
        late = old.add_request("late", PROMPTS[3], GREEDY, remote=True)
        prefill.submit(queued)
        prefill.transport.add_peer(new.transport.metadata())  # the restart: same name "decode"
        assert new.transport.session != old.transport.session
        with pytest.raises(ValueError, match="not a peer in the session that reserved these blocks"):
            prefill.submit(late)
        new.engine.kv_cache.fill_(-7.0)
        end, results = time.monotonic() + 30, []
        while not results:
            assert time.monotonic() < end, "the queued job never ended"
            results = prefill.step()
            new.step()
        assert [(r.request_id, r.error) for r in results] == [("queued", "decode worker 'decode' is gone or restarted")]
        assert (new.engine.kv_cache == -7.0).all(), "a write meant for the old worker landed in the new one"
        assert prefill.engine.kv.num_free_blocks == prefill.engine.kv.pool.num_blocks
    finally:
        for core in (old, new, prefill, new_prefill):
            core.transport.close()


def slow_copies(transport: ShmTransport, delay_s: float) -> ThreadPoolExecutor:
    """Every shm write's copy starts `delay_s` late, all at once: a data plane slower than
    an engine step (on GPUs, cuda_ipc's and NIXL's copies run beside the compute stream)."""
    pool = ThreadPoolExecutor(32)
    copy = torch._foreach_copy_

    def start(peer, write) -> None:
        regions = shm._regions(write, transport._peer_bytes[peer.name], transport._rank_layers,
                               transport.registered_compat.num_layers)
        runs = ([to for to, _ in regions], [frm for _, frm in regions])
        write.handle = pool.submit(lambda: (time.sleep(delay_s), copy(*runs)))

    transport._start = start
    return pool


@pytest.mark.timeout(120)
def test_a_preempted_prefill_keeps_its_blocks_until_their_writes_land(llama_dir: Path) -> None:
    """The prefill engine runs out of blocks and preempts prompts whose full blocks are
    still being copied out: those blocks must not be given to another prompt (whose KV
    would then be what the decode worker gets) before the copy has read them."""
    prompts = random_prompts([90, 90, 90, 90], seed=3)
    llm = LLM(str(llama_dir), num_kv_blocks=80)
    expected = [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    # 8 blocks of 16 tokens for four 90-token prompts, and no prefix cache to hide a reuse.
    decode, prefill = worker_pair(llama_dir, "shm", prefill_blocks=8, prefix_caching=False)
    pool = slow_copies(prefill.transport, delay_s=0.3)
    try:
        for i, prompt in enumerate(prompts):
            prefill.submit(decode.add_request(f"r{i}", prompt, GREEDY, remote=True))
        outputs, end = {}, time.monotonic() + 90
        while len(outputs) < len(prompts):
            assert time.monotonic() < end, "disaggregated run did not finish"
            assert all(r.error is None for r in prefill.step())
            outputs.update((r.request_id, r.output_token_ids) for r in decode.step().finished)
        assert prefill.engine.scheduler.num_preemptions > 0, "no preemption: the test tests nothing"
        assert decode.stats["fallbacks"] == 0
        assert [outputs[f"r{i}"] for i in range(len(prompts))] == expected
        assert prefill.engine.kv.num_free_blocks == prefill.engine.kv.pool.num_blocks
    finally:
        pool.shutdown(wait=True)
        decode.transport.close()
        prefill.transport.close()
