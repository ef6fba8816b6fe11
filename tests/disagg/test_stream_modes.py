"""transport_options.stream: when a prefill worker writes a prompt's KV. "chunk" posts
each block as soon as a step has computed it (a chunked prompt moves while its later
chunks compute); "layer" posts a step's blocks stream_layers layers at a time from inside
the step; "off", and any prompt under stream_min_tokens, posts every block in one write
once the whole prompt is computed. Either way the decode worker's tokens are the
colocated engine's."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from decode_worker.remote_kv import DecodeWorkerCore
from engine.errors import RequestsFailed
from kv_transfer import TransportConfig
from prefill_worker.remote_prefill import PrefillWorkerCore
from protocol import PrefillDone
from tests.disagg.test_remote_prefill import GREEDY, PROMPTS, settle_fences, worker_pair

LONG = 64  # PROMPTS[3]: 64 tokens, three 24-token chunks on the prefill engine (worker_pair)
LONGEST = 90  # PROMPTS[4]: four chunks, so a fault can strike after the first has landed


def run_counting(decode: DecodeWorkerCore, prefill: PrefillWorkerCore,
                 timeout: float = 60.0) -> tuple[dict[str, list[int]], dict[str, int], dict[str, PrefillDone]]:
    """PROMPTS through the pair one at a time: (tokens, writes posted, prefill_done) by request."""
    writes: dict[str, int] = {}
    write = prefill.transport.write

    def counted(peer, request_id, *args, **kwargs):
        writes[request_id] = writes.get(request_id, 0) + 1
        return write(peer, request_id, *args, **kwargs)

    prefill.transport.write = counted  # type: ignore[method-assign]
    out, done = {}, {}
    for i, prompt in enumerate(PROMPTS):
        rp = decode.add_request(f"r{i}", prompt, GREEDY, remote=True, sender="prefill")
        assert rp is not None
        prefill.submit(rp)
        end = time.monotonic() + timeout
        while decode.engine.has_unfinished() or prefill.engine.has_unfinished() or prefill.jobs:
            assert time.monotonic() < end, "disaggregated run did not finish"
            for result in prefill.step():
                assert result.error is None, result.error
                done[result.request_id] = result
            for r in decode.step().finished:
                out[r.request_id] = r.output_token_ids
    return out, writes, done


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", ["shm", "tcp"])
@pytest.mark.parametrize("stream,min_tokens,layers", [
    ("chunk", 0, 1), ("off", 0, 1), ("chunk", 1000, 1), ("chunk", LONG, 1), ("chunk", LONG + 1, 1),
    ("layer", 0, 1), ("layer", 0, 2), ("layer", LONG, 1), ("layer", LONG + 1, 1)])
def test_each_mode_gives_colocated_tokens_and_posts_when_it_says(llama_dir: Path, reference, transport: str,
                                                                  stream: str, min_tokens: int, layers: int) -> None:
    decode, prefill = worker_pair(llama_dir, transport, stream=stream, stream_min_tokens=min_tokens,
                                  prefix_caching=False, stream_layers=layers)
    try:
        got, writes, done = run_counting(decode, prefill)
        assert got == reference
        long_id = f"r{PROMPTS.index(next(p for p in PROMPTS if len(p) == LONG))}"
        # 63 tokens to push in chunks of 24: blocks 0 after the first, 1-2 after the
        # second, 3 (partial) at the end; written while the next chunk computed, or (layer)
        # each of the tiny model's 2 layers as soon as computed, `layers` at a time.
        if stream == "chunk" and min_tokens <= LONG:  # "shorter than stream_min_tokens": whole
            assert writes[long_id] == 3
        elif stream == "layer" and min_tokens <= LONG:
            assert writes[long_id] == 3 * 2 // layers
        else:
            assert writes[long_id] == 1
        if stream == "off" or min_tokens > max(len(p) for p in PROMPTS):
            assert all(n == 1 for n in writes.values()), writes
        assert all(d.error is None and d.bytes_written > 0 for d in done.values())
        for core in (decode.engine, prefill.engine):
            assert core.kv.num_free_blocks == core.kv.pool.num_blocks, "blocks leaked"
    finally:
        decode.transport.close()
        prefill.transport.close()


@pytest.mark.parametrize("options,error", [
    (dict(stream="layers"), r"stream must be one of \('off', 'chunk', 'layer'\), got 'layers'"),
    (dict(stream_layers=0), "stream_layers must be an integer >= 1, got 0"),
    (dict(stream_min_tokens=-1), "stream_min_tokens must be an integer >= 0, got -1"),
    (dict(stream_min_tokens=True), "stream_min_tokens must be an integer >= 0, got True"),
])
def test_bad_stream_options_are_refused_naming_them(options: dict, error: str) -> None:
    with pytest.raises(ValueError, match=error):
        TransportConfig(**options)


def step_until_first_chunk_landed(decode: DecodeWorkerCore, prefill: PrefillWorkerCore, request_id: str,
                                  timeout: float = 30.0) -> None:
    """Step both until the prompt's first chunk of blocks is acknowledged while the rest
    still computes: mid-stream."""
    end, first = time.monotonic() + timeout, None
    while True:
        assert time.monotonic() < end, "the first chunk never landed"
        for result in prefill.step():
            raise AssertionError(f"the prefill ended before the test's fault: {result}")
        job = prefill.jobs[request_id]
        if first is None and job.outstanding:
            first = min(job.outstanding)
        if first is not None and first not in job.outstanding:
            assert not prefill.engine.is_prefilled(request_id), "not mid-stream: the prompt is computed"
            return
        for _ in range(5):  # time for the write to land and its ack to come back before P's next step
            decode.step()
            time.sleep(0.01)


def start_mid_stream(decode: DecodeWorkerCore, prefill: PrefillWorkerCore) -> str:
    """The longest prompt, pushed until its first chunk has landed; returns its id."""
    index = next(i for i, p in enumerate(PROMPTS) if len(p) == LONGEST)
    request_id = f"r{index}"
    rp = decode.add_request(request_id, PROMPTS[index], GREEDY, remote=True, sender="prefill")
    assert rp is not None
    prefill.submit(rp)
    step_until_first_chunk_landed(decode, prefill, request_id)
    return request_id


def finish(decode: DecodeWorkerCore, prefill: PrefillWorkerCore | None, request_id: str,
           timeout: float = 30.0) -> list[int]:
    end = time.monotonic() + timeout
    while True:
        assert time.monotonic() < end, f"{request_id} did not finish"
        if prefill is not None:
            for result in prefill.step():
                if result.error is not None:
                    decode.prefill_failed(result.request_id)
        for r in decode.step().finished:
            if r.request_id == request_id:
                return r.output_token_ids


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", ["shm", "tcp"])
@pytest.mark.parametrize("stream", ["chunk", "layer"])
def test_a_prefill_worker_gone_silent_mid_stream_is_prefilled_locally(llama_dir: Path, reference,
                                                                       transport: str, stream: str) -> None:
    """Its first chunk landed, then it stops (a hung or killed host): the reservation
    expires, the decode worker prefills the prompt itself, and every block comes back."""
    decode, prefill = worker_pair(llama_dir, transport, deadline_s=1.0, grace_s=0.2, prefix_caching=False,
                                  stream=stream)
    try:
        request_id = start_mid_stream(decode, prefill)
        assert finish(decode, None, request_id) == reference[request_id]
        assert decode.stats["fallbacks"] == 1
        settle_fences(decode, prefill)  # it speaks again: a one-sided transport's fenced blocks come back
        assert decode.engine.kv.num_free_blocks == decode.engine.kv.pool.num_blocks, "blocks leaked"
    finally:
        decode.transport.close()
        prefill.transport.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", ["shm", "tcp", "nixl"])
@pytest.mark.parametrize("after_layers", [1, 3])
def test_a_prefill_worker_dead_after_some_layers_leaves_no_block_runnable(llama_dir: Path, reference,
                                                                          transport: str, after_layers: int) -> None:
    """Layer mode: P dies inside a step, some layers of its blocks written (1: the first
    step's first layer only; 3: the first step's blocks whole, then one layer of the
    second step's). D never counts a block with a layer missing: the reservation
    expires, D prefills the prompt itself, the colocated engine's tokens, no leak."""
    decode, prefill = worker_pair(llama_dir, transport, deadline_s=1.0, grace_s=0.2, prefix_caching=False,
                                  stream="layer")
    hooked: list[int] = []

    def dies(layer: int, computed) -> None:
        prefill._layer_written(layer, computed)
        hooked.append(layer)
        if len(hooked) == after_layers:
            raise RuntimeError("killed")

    prefill.engine.set_layer_hook(dies)
    try:
        index = next(i for i, p in enumerate(PROMPTS) if len(p) == LONGEST)
        request_id = f"r{index}"
        rp = decode.add_request(request_id, PROMPTS[index], GREEDY, remote=True, sender="prefill")
        assert rp is not None
        prefill.submit(rp)
        with pytest.raises(RequestsFailed, match="killed"):
            for _ in range(10):
                prefill.step()
                decode.step()
        assert prefill.transport.stats["writes"] == after_layers  # one per layer written before it died
        assert finish(decode, None, request_id) == reference[request_id]
        assert decode.stats["fallbacks"] == 1 and decode.stats["remote"] == 1
        settle_fences(decode, prefill)
        assert decode.engine.kv.num_free_blocks == decode.engine.kv.pool.num_blocks, "blocks leaked"
    finally:
        decode.transport.close()
        prefill.transport.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", ["shm", "tcp"])
@pytest.mark.parametrize("stream", ["chunk", "layer"])
def test_an_abort_mid_stream_ends_both_sides_and_leaks_nothing(llama_dir: Path, reference, transport: str,
                                                               stream: str) -> None:
    decode, prefill = worker_pair(llama_dir, transport, prefix_caching=False, stream=stream)
    try:
        request_id = start_mid_stream(decode, prefill)
        decode.abort(request_id)
        end = time.monotonic() + 30
        ended = []
        while prefill.jobs or decode.quarantined_blocks() or decode.transport.holds_reservations():
            assert time.monotonic() < end, "the aborted stream did not settle"
            ended += prefill.step()
            decode.step()
        # P learns of it from the transport (D's cancel, or a refused write), as when a
        # worker-plane Abort is slow.
        assert [r.request_id for r in ended] == [request_id] and ended[0].error is not None
        for core in (decode.engine, prefill.engine):
            assert core.kv.num_free_blocks == core.kv.pool.num_blocks, "blocks leaked"
        # The same id again, streamed whole this time: the colocated engine's tokens.
        rp = decode.add_request(request_id, PROMPTS[int(request_id[1:])], GREEDY, remote=True, sender="prefill")
        assert rp is not None
        prefill.submit(rp)
        assert finish(decode, prefill, request_id) == reference[request_id]
    finally:
        decode.transport.close()
        prefill.transport.close()
