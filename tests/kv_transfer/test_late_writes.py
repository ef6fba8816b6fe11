"""Writes whose bytes would land late (issue 23, finding 3).

shm: a copy that starts after the reservation's deadline never starts, and one still
running at deadline + cancel_grace_s / 2 stops between chunks, so nothing lands in
blocks the receiver released (at deadline + cancel_grace_s) and reused. tcp: a write
fails only once ZMQ has let go of its frames (sent zero-copy from the source blocks).
The receiver: a one-sided write that lands after all in released blocks is reported
(Overwritten), and the decode worker fails the requests holding them.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import msgpack
import pytest
import torch
import zmq

import kv_transfer.shm as shm
from decode_worker.remote_kv import DecodeWorkerCore
from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.engine_core import EngineCore
from kv_transfer import (KVTransport, Overwritten, Released, TransportConfig, WriteDone, WriteFailed,
                         create_transport)
from prefill_worker.remote_prefill import PrefillWorkerCore
from tests.kv_transfer.agent import cache_shape
from tests.kv_transfer.test_slow_data_plane import poll_both

SENTINEL, PAYLOAD = -7.0, 1.0
PROMPT_A, PROMPT_B = (torch.randint(2, 384, (40,), generator=torch.Generator().manual_seed(seed)).tolist()
                      for seed in (21, 22))
GREEDY_B = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


# ------------------------------------------------------------------------------ helpers

def agent(transport: str, name: str, timeout_s: float = 5.0, grace_s: float = 60.0) -> KVTransport:
    t = create_transport(transport, name, TransportConfig(timeout_s=timeout_s, cancel_grace_s=grace_s))
    cache = t.allocate_kv_cache(cache_shape(), torch.float32, "cpu")
    cache.fill_(SENTINEL)
    t.register_kv_cache(cache, "test-model")
    return t


def block_busy_pool(transport: KVTransport, gate: threading.Event) -> None:
    """Occupy every thread of the shm transport's copy pool until `gate` is set: the
    copies submitted meanwhile start late, through the real copy path."""
    for _ in range(transport._pool._max_workers):
        transport._pool.submit(gate.wait, 30)


def gated_start(sender: KVTransport, gate: threading.Event, pool: ThreadPoolExecutor) -> None:
    """A late landing that bypasses the sender's own checks (like ../shared/repro's
    f3): each write's copy waits for `gate`, then copies everything."""
    def start(peer, write) -> None:
        dst = sender._peer_bytes[peer.name][0]  # rank 0: TP 1
        runs = ([dst[d:d + n] for _, d, n in write.runs], [sender._blocks_bytes[s:s + n] for s, _, n in write.runs])
        write.handle = pool.submit(lambda: (gate.wait(30), torch._foreach_copy_(*runs)))

    sender._start = start


@pytest.fixture
def workers(llama_dir: Path) -> Iterator:
    """make(grace_s) -> (decode worker, prefill worker) joined by shm: a decode pool of 4
    blocks (the second request can only get the first one's blocks), a 0.4 s deadline."""
    made: list = []

    def make(grace_s: float = 0.2) -> tuple[DecodeWorkerCore, PrefillWorkerCore]:
        config = TransportConfig(timeout_s=5.0, cancel_grace_s=grace_s)
        t_dec, t_pre = create_transport("shm", "decode", config), create_transport("shm", "prefill", config)
        made.extend((t_dec, t_pre))
        dec = EngineCore(EngineConfig(model=str(llama_dir), num_kv_blocks=4), t_dec.allocate_kv_cache)
        pre = EngineCore(EngineConfig(model=str(llama_dir), num_kv_blocks=80, max_num_batched_tokens=24),
                         t_pre.allocate_kv_cache)
        for t, core in ((t_dec, dec), (t_pre, pre)):
            t.register_kv_cache(core.kv_cache, "tiny-llama")
        t_pre.add_peer(t_dec.metadata())
        return DecodeWorkerCore(dec, t_dec, deadline_s=0.4), PrefillWorkerCore(pre, t_pre)

    yield make
    for t in made:
        t.close()


def start_and_release_a(dec: DecodeWorkerCore, pre: PrefillWorkerCore) -> list[int]:
    """Request A: P starts every write (before the deadline) whose copies are then held
    back; D aborts A and, no cancel_ack coming (it never learnt the sender), releases its
    blocks at deadline + cancel_grace_s. Returns A's destination blocks."""
    rp = dec.add_request("A", PROMPT_A, SamplingParams(max_tokens=4, temperature=0.0), remote=True)
    pre.submit(rp)
    end = time.monotonic() + 10
    while pre.stats["blocks_written"] < 3:
        assert time.monotonic() < end, "P never started A's writes"
        pre.step()
        dec.step()
    assert time.time() < rp.deadline, "the writes must start before the deadline"
    dec.abort("A")
    while "A" in dec.engine.scheduler.requests:  # waits for Released
        assert time.monotonic() < end, "A was never released"
        pre.step()
        dec.step()
        time.sleep(0.005)
    assert time.time() > rp.deadline + pre.transport.config.cancel_grace_s
    return rp.block_ids[:3]


def start_b(dec: DecodeWorkerCore) -> None:
    """Request B, prefilled locally into the blocks A had."""
    dec.add_request("B", PROMPT_B, GREEDY_B, remote=False)
    end = time.monotonic() + 10
    while not dec.engine.scheduler.requests["B"].output_token_ids:
        assert time.monotonic() < end
        dec.step()


# ------------------------------------------------------------------------------ shm, P side

@pytest.mark.timeout(60)
def test_a_copy_that_starts_after_the_deadline_never_lands_in_the_reused_blocks(workers, llama_dir: Path) -> None:
    """The f3 scenario through the real copy path: A's copies wait behind a busy pool
    until after D released A's blocks and gave them to B. They must not start: A's
    writes fail saying so, B's blocks keep their contents and B its colocated tokens."""
    reference = LLM(str(llama_dir), num_kv_blocks=80).generate([PROMPT_B], GREEDY_B, use_tqdm=False)[0].token_ids
    dec, pre = workers()
    gate = threading.Event()
    try:
        block_busy_pool(pre.transport, gate)
        a_blocks = start_and_release_a(dec, pre)
        start_b(dec)
        # B's full prompt blocks (never written again) that A's writes target.
        watched = [b for b in dec.engine.kv.block_ids("B")[:2] if b in a_blocks]
        assert watched
        before = dec.engine.kv_cache[watched].clone()

        gate.set()  # A's copies start now, 1+ s after its deadline
        results, end = [], time.monotonic() + 10
        while not results:
            assert time.monotonic() < end, "A's writes never failed"
            results += pre.step()
            dec.step()
        assert [(r.request_id, r.error) for r in results] == [
            ("A", "data plane error: deadline passed before the copy started")]
        assert torch.equal(dec.engine.kv_cache[watched], before), "a late copy landed in B's blocks"

        out, end = None, time.monotonic() + 20
        while out is None:
            assert time.monotonic() < end
            pre.step()
            for r in dec.step().finished:
                out = r.output_token_ids
        assert out == reference
        assert dec.transport.stats["overwritten"] == 0
    finally:
        gate.set()


@pytest.mark.timeout(60)
def test_a_copy_still_running_at_deadline_plus_half_the_grace_stops_between_chunks(monkeypatch) -> None:
    """Chunks of one block, each taking 50 ms: a copy that started just before the
    deadline stops at deadline + cancel_grace_s / 2, the chunks before it landed and
    none after; the write fails saying why."""
    decode, prefill = agent("shm", "decode"), agent("shm", "prefill", grace_s=0.4)
    landed: list[float] = []
    real = torch._foreach_copy_

    def slow_chunk(to, frm) -> None:
        time.sleep(0.05)
        real(to, frm)
        landed.append(time.time())

    monkeypatch.setattr(shm, "CHUNK_BYTES", 1, raising=False)  # one block per chunk (at least one)
    monkeypatch.setattr(shm, "_copy_chunk", slow_chunk, raising=False)
    try:
        prefill.kv_cache[:16].fill_(PAYLOAD)
        prefill.add_peer(decode.metadata())
        deadline = time.time() + 0.1
        decode.expect("a", 1, list(range(16)), deadline=deadline)
        prefill.write("decode", "a", 1, list(range(16)), list(range(16)), deadline=deadline)
        failed, end = [], time.monotonic() + 10
        while not failed:
            assert time.monotonic() < end, "the write never ended"
            sent, _ = poll_both(prefill, decode, 0.01)
            assert not [e for e in sent if isinstance(e, WriteDone)]
            failed += [e for e in sent if isinstance(e, WriteFailed)]
        assert failed[0].reason.startswith("copy stopped after ")
        copied = len(landed)
        assert 1 <= copied < 16
        assert max(landed) < deadline + 0.2 + 0.15  # stop_at, plus the one chunk then under way
        assert bool((decode.kv_cache[:copied] == PAYLOAD).all())
        assert bool((decode.kv_cache[copied:16] == SENTINEL).all())
    finally:
        prefill.close()
        decode.close()


@pytest.mark.timeout(60)
def test_cancelling_a_write_whose_copy_never_started_fails_it_without_raising() -> None:
    """The copy pool reaches a write only after its deadline, so its copy refuses to
    start; a cancel of it (the receiver's, or the prefill worker's own) raised the
    copy's error out of cancel() or poll() and brought the prefill worker down."""
    decode, prefill = agent("shm", "decode"), agent("shm", "prefill")
    gate = threading.Event()
    try:
        prefill.add_peer(decode.metadata())
        block_busy_pool(prefill, gate)
        deadline = time.time() + 0.05
        decode.expect("a", 1, [2, 3], deadline=deadline)
        prefill.write("decode", "a", 1, [0, 1], [2, 3], deadline=deadline)
        time.sleep(0.1)
        gate.set()  # the copy now starts, past the deadline: it refuses
        handle = next(iter(prefill.sending.writes.values())).handle
        handle.exception(timeout=5)
        prefill.cancel("a")
        sent, _ = poll_both(prefill, decode, 0.05)
        assert [(type(e), e.reason) for e in sent] == [(WriteFailed, "data plane error: deadline passed before "
                                                                     "the copy started")]
        assert bool((decode.kv_cache[2:4] == SENTINEL).all())
    finally:
        gate.set()
        prefill.close()
        decode.close()


@pytest.mark.timeout(60)
def test_a_stopped_copy_whose_first_chunk_landed_late_is_reported_overwritten(monkeypatch) -> None:
    """The first chunk starts before the deadline but lands after the receiver released
    its blocks; the copy then stops before the next chunk. The receiver must still hear
    of the bytes that landed (the write failed without its notification, silently)."""
    decode, prefill = agent("shm", "decode", grace_s=0.2), agent("shm", "prefill", grace_s=0.4)
    real = torch._foreach_copy_
    calls = []

    def first_chunk_slow(to, frm) -> None:
        calls.append(time.time())
        if len(calls) == 1:
            time.sleep(0.8)  # lands after deadline + the receiver's grace (0.3 s)
        real(to, frm)

    monkeypatch.setattr(shm, "CHUNK_BYTES", 1, raising=False)  # one block per chunk
    monkeypatch.setattr(shm, "_copy_chunk", first_chunk_slow, raising=False)
    try:
        prefill.kv_cache[:4].fill_(PAYLOAD)
        prefill.add_peer(decode.metadata())
        deadline = time.time() + 0.1
        decode.expect("a", 1, [0, 1, 2, 3], deadline=deadline)
        prefill.write("decode", "a", 1, [0, 1, 2, 3], [0, 1, 2, 3], deadline=deadline)
        sent, received, end = [], [], time.monotonic() + 10
        while not sent or not [e for e in received if isinstance(e, Overwritten)]:
            assert time.monotonic() < end, f"no Overwritten: sent {sent}, received {received}"
            more_sent, more_received = poll_both(prefill, decode, 0.01)
            sent += more_sent
            received += more_received
        assert [type(e) for e in sent] == [WriteFailed] and sent[0].reason.startswith("copy stopped after 1 of 4")
        assert Released("a", 1, (0, 1, 2, 3)) in received
        assert [e for e in received if isinstance(e, Overwritten)] == [Overwritten("a", 1, (0, 1, 2, 3))]
    finally:
        prefill.close()
        decode.close()


# ------------------------------------------------------------------------------ tcp, P side

class TrackingSocket:
    """Stands in for a peer's control socket: sends through it with every frame
    tracked, and keeps the trackers, to tell when ZMQ let go of a write's frames."""

    def __init__(self, sock: zmq.Socket) -> None:
        self.sock = sock
        self.trackers: list[zmq.MessageTracker] = []

    def send(self, data, flags: int = 0, copy: bool = True, track: bool = False):
        tracker = self.sock.send(data, flags, copy=copy, track=True)
        self.trackers.append(tracker)
        return tracker if track else None

    def send_multipart(self, frames, flags: int = 0, copy: bool = True, track: bool = False):
        for frame in frames[:-1]:
            self.send(frame, flags | zmq.SNDMORE, copy=copy)
        return self.send(frames[-1], flags, copy=copy, track=track)

    def __getattr__(self, name: str):
        return getattr(self.sock, name)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("ending", ["timeout", "peer_gone"])
def test_a_tcp_write_fails_only_once_zmq_let_go_of_its_frames(ending: str) -> None:
    """The receiver's control address leads to a socket that never reads (its process
    stopped): the write's frames, sent zero-copy from the source blocks, stay queued in
    ZMQ. Its WriteFailed (the caller reuses the source blocks on it) must not come while
    ZMQ still holds them, and must still come, after the timeout or peer_gone()."""
    decode = agent("tcp", "decode")
    prefill = agent("tcp", "prefill", timeout_s=0.2 if ending == "timeout" else 60.0)
    stuck = socket.socket()
    try:
        stuck.bind(("127.0.0.1", 0))
        stuck.listen(4)  # connections complete in the kernel; nothing ever reads them
        meta = msgpack.unpackb(decode.metadata(), raw=False)
        meta["control"] = f"tcp://127.0.0.1:{stuck.getsockname()[1]}"
        prefill.add_peer(msgpack.packb(meta, use_bin_type=True))
        tracking = TrackingSocket(prefill.control.peers["decode"].socket)
        prefill.control.peers["decode"].socket = tracking
        time.sleep(0.1)
        # 16 blocks of 16 KiB in one run: one frame, above ZMQ's copy threshold (64 KiB).
        xfer = prefill.write("decode", "a", 1, list(range(16)), list(range(16)), deadline=time.time() + 60)
        assert len(tracking.trackers) == 2 and not tracking.trackers[1].done, "the frames were not held"
        time.sleep(0.3)  # past the timeout
        if ending == "peer_gone":
            prefill.peer_gone("decode")
        failed, end = [], time.monotonic() + 5
        while not failed:
            assert time.monotonic() < end, "the write never failed"
            events = prefill.poll()  # no sleep before the first: right after peer_gone()
            failed = [e for e in events if isinstance(e, WriteFailed)]
            assert not failed or all(t.done for t in tracking.trackers), \
                "WriteFailed while ZMQ still held the write's frames (its source blocks)"
            time.sleep(0.001)
        assert [e.xfer for e in failed] == [xfer]
        assert failed[0].reason == ("no acknowledgement from 'decode' within 0.2 s" if ending == "timeout"
                                    else "peer 'decode' is gone")
    finally:
        stuck.close()
        prefill.close()
        decode.close()


# ------------------------------------------------------------------------------ D side

@pytest.mark.timeout(60)
@pytest.mark.parametrize("cancelled", [False, True])
def test_a_one_sided_write_landing_in_released_blocks_is_reported_overwritten(cancelled: bool) -> None:
    """A copy that bypasses the sender's checks lands after the receiver released the
    blocks: the receiver refuses the write, and reports Overwritten naming the blocks.
    Also when the sender cancelled the write meanwhile: its bytes landed all the same,
    and the receiver must hear of them (it did not: the write failed silently)."""
    decode, prefill = agent("shm", "decode", grace_s=0.2), agent("shm", "prefill")
    gate, pool = threading.Event(), ThreadPoolExecutor(2)
    try:
        prefill.kv_cache[:2].fill_(PAYLOAD)
        gated_start(prefill, gate, pool)
        prefill.add_peer(decode.metadata())
        decode.expect("a", 1, [2, 3, 5], deadline=time.time() + 0.2)
        prefill.write("decode", "a", 1, [0, 1], [2, 3], deadline=time.time() + 0.2)
        if cancelled:
            prefill.cancel("a")
        decode.abort("a")  # the sender is unknown: released at deadline + grace
        received, end = [], time.monotonic() + 5
        while not [e for e in received if isinstance(e, Released)]:
            assert time.monotonic() < end, "never released"
            received += poll_both(prefill, decode, 0.01)[1]
        assert not [e for e in received if isinstance(e, Overwritten)]

        gate.set()
        sent, received, end = [], [], time.monotonic() + 5
        while not sent:
            assert time.monotonic() < end, "the write never ended"
            more_sent, more_received = poll_both(prefill, decode, 0.01)
            sent += [e for e in more_sent if isinstance(e, (WriteDone, WriteFailed))]
            received += more_received
        received += poll_both(prefill, decode, 0.05)[1]
        assert [e for e in received if isinstance(e, Overwritten)] == [Overwritten("a", 1, (2, 3))]
        assert [type(e) for e in sent] == [WriteFailed]
        assert sent[0].reason == "cancelled" if cancelled else "already released" in sent[0].reason, sent[0].reason
        assert decode.stats["overwritten"] == 1
    finally:
        gate.set()
        pool.shutdown(wait=True)
        prefill.close()
        decode.close()


@pytest.mark.timeout(60)
@pytest.mark.skipif(not hasattr(EngineCore, "invalidate_blocks"),
                    reason="needs EngineCore.invalidate_blocks (engine/ adds it)")
def test_the_decode_worker_fails_the_requests_holding_overwritten_blocks(workers) -> None:
    """f3 with a late landing that bypasses the sender's checks: B, prefilled into the
    blocks A had, is aborted and listed in DecodeWorkerCore.corrupted."""
    dec, pre = workers()
    gate, pool = threading.Event(), ThreadPoolExecutor(2)
    try:
        gated_start(pre.transport, gate, pool)
        start_and_release_a(dec, pre)
        start_b(dec)
        gate.set()
        end = time.monotonic() + 10
        while not dec.corrupted:
            assert time.monotonic() < end, "the overwrite was never reported"
            pre.step()
            dec.step()
            time.sleep(0.005)
        assert dec.corrupted == ["B"]
        assert "B" not in dec.engine.scheduler.requests
        assert dec.transport.stats["overwritten"] >= 1
    finally:
        gate.set()
        pool.shutdown(wait=True)
