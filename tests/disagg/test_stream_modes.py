"""transport_options.stream: when a prefill worker writes a prompt's KV. "chunk" posts
each block as soon as a step has computed it (a chunked prompt moves while its later
chunks compute); "off", and any prompt under stream_min_tokens, posts every block in one
write once the whole prompt is computed. Either way the decode worker's tokens are the
colocated engine's."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from decode_worker.remote_kv import DecodeWorkerCore
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
@pytest.mark.parametrize("stream,min_tokens", [("chunk", 0), ("off", 0), ("chunk", 1000), ("chunk", LONG),
                                               ("chunk", LONG + 1)])
def test_each_mode_gives_colocated_tokens_and_posts_when_it_says(llama_dir: Path, reference, transport: str,
                                                                  stream: str, min_tokens: int) -> None:
    decode, prefill = worker_pair(llama_dir, transport, stream=stream, stream_min_tokens=min_tokens,
                                  prefix_caching=False)
    try:
        got, writes, done = run_counting(decode, prefill)
        assert got == reference
        long_id = f"r{PROMPTS.index(next(p for p in PROMPTS if len(p) == LONG))}"
        if stream == "chunk" and min_tokens <= LONG:  # "shorter than stream_min_tokens": whole
            # 63 tokens to push in chunks of 24: blocks 0 after the first, 1-2 after the
            # second, 3 (partial) at the end; written while the next chunk computed.
            assert writes[long_id] == 3
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
    (dict(stream="layer"), r"stream must be one of \('off', 'chunk'\), got 'layer'"),
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
def test_a_prefill_worker_gone_silent_mid_stream_is_prefilled_locally(llama_dir: Path, reference,
                                                                       transport: str) -> None:
    """Its first chunk landed, then it stops (a hung or killed host): the reservation
    expires, the decode worker prefills the prompt itself, and every block comes back."""
    decode, prefill = worker_pair(llama_dir, transport, deadline_s=1.0, grace_s=0.2, prefix_caching=False)
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
@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_an_abort_mid_stream_ends_both_sides_and_leaks_nothing(llama_dir: Path, reference, transport: str) -> None:
    decode, prefill = worker_pair(llama_dir, transport, prefix_caching=False)
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
