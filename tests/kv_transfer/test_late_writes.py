"""Writes whose bytes would land late (issues 23 and 34).

The fence (kv_transfer/receiver.py, decode_worker/remote_kv.py): the receiver frees
the blocks of a reservation it gave up on only on the sender's cancel_ack, which the
sender sends once none of its bytes can land, or once the sender's process is gone,
never on a timer. A copy stalled for any time therefore lands in blocks nobody else
holds. shm's own bounds (a copy that starts after the deadline never starts; one still
running at deadline + cancel_grace_s / 2 stops between chunks) only bound how long the
fence lasts. tcp: a write fails only once ZMQ has let go of its frames (sent zero-copy
from the source blocks). The alarm behind the fence: a one-sided write that lands in
released blocks all the same (a broken transport, forced here) is reported
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
from kv_transfer import KVTransport, Overwritten, Released, TransportConfig, WriteDone, WriteFailed, create_transport
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
        regions = shm._regions(write, sender._peer_bytes[peer.name], sender._rank_layers,
                               sender.registered_compat.num_layers)
        runs = ([to for to, _ in regions], [frm for _, frm in regions])
        write.handle = pool.submit(lambda: (gate.wait(30), torch._foreach_copy_(*runs)))

    sender._start = start


@pytest.fixture
def workers(llama_dir: Path) -> Iterator:
    """make(grace_s, dec_blocks) -> (decode worker, prefill worker) joined by shm: a decode
    pool of 4 blocks by default (the second request can only get the first one's
    blocks), a 0.4 s deadline."""
    made: list = []

    def make(grace_s: float = 0.2, dec_blocks: int = 4) -> tuple[DecodeWorkerCore, PrefillWorkerCore]:
        config = TransportConfig(timeout_s=5.0, cancel_grace_s=grace_s)
        t_dec, t_pre = create_transport("shm", "decode", config), create_transport("shm", "prefill", config)
        made.extend((t_dec, t_pre))
        dec = EngineCore(EngineConfig(model=str(llama_dir), num_kv_blocks=dec_blocks), t_dec.allocate_kv_cache)
        pre = EngineCore(EngineConfig(model=str(llama_dir), num_kv_blocks=80, max_num_batched_tokens=24),
                         t_pre.allocate_kv_cache)
        for t, core in ((t_dec, dec), (t_pre, pre)):
            t.register_kv_cache(core.kv_cache, "tiny-llama")
        t_pre.add_peer(t_dec.metadata())
        return DecodeWorkerCore(dec, t_dec, deadline_s=0.4), PrefillWorkerCore(pre, t_pre)

    yield make
    for t in made:
        t.close()


def start_and_abort_a(dec: DecodeWorkerCore, pre: PrefillWorkerCore) -> list[int]:
    """Request A: P starts every write (before the deadline) whose copies are then held
    back; D aborts A, which ends at once while its blocks stay fenced. Returns A's
    destination blocks."""
    rp = dec.add_request("A", PROMPT_A, SamplingParams(max_tokens=4, temperature=0.0), remote=True,
                         sender="prefill")
    pre.submit(rp)
    end = time.monotonic() + 10
    while pre.stats["blocks_written"] < 3:
        assert time.monotonic() < end, "P never started A's writes"
        pre.step()
        dec.step()
    assert time.time() < rp.deadline, "the writes must start before the deadline"
    dec.abort("A")
    assert "A" not in dec.engine.scheduler.requests  # ended now
    assert dec.quarantined_blocks() == 3  # its blocks are not
    return rp.block_ids[:3]


def start_b(dec: DecodeWorkerCore, pre: PrefillWorkerCore | None = None) -> None:
    """Request B, prefilled locally: into the blocks A had, once they are released."""
    dec.add_request("B", PROMPT_B, GREEDY_B, remote=False)
    end = time.monotonic() + 10
    while not dec.engine.scheduler.requests["B"].output_token_ids:
        assert time.monotonic() < end
        if pre is not None:
            pre.step()
        dec.step()


# ------------------------------------------------------------------------------ shm, P side

@pytest.mark.timeout(60)
def test_a_request_waits_for_the_blocks_of_a_copy_that_has_not_started_and_never_reads_its_bytes(
        workers, llama_dir: Path) -> None:
    """A's copies wait behind a busy pool, past A's deadline and any grace. D aborts A
    at once, but its blocks stay fenced: B, which can only get those blocks, waits.
    Once the copies refuse to start (too late) P confirms, D releases the blocks, and
    B runs in them with the colocated engine's tokens. Nothing of A ever landed."""
    reference = LLM(str(llama_dir), num_kv_blocks=80).generate([PROMPT_B], GREEDY_B, use_tqdm=False)[0].token_ids
    dec, pre = workers()
    gate = threading.Event()
    try:
        block_busy_pool(pre.transport, gate)
        a_blocks = start_and_abort_a(dec, pre)
        dec.add_request("B", PROMPT_B, GREEDY_B, remote=False)
        stall_until = time.time() + 1.0  # well past A's deadline + cancel_grace_s (0.4 + 0.2 s)
        while time.time() < stall_until:
            pre.step()
            assert not dec.step().num_tokens, "B ran while A's blocks could still be written"
            time.sleep(0.01)
        assert dec.quarantined_blocks() == 3 and dec.transport.quarantined_blocks() == 3
        before = dec.engine.kv_cache[a_blocks].clone()

        gate.set()  # A's copies start now, past the deadline: they refuse
        results, end = [], time.monotonic() + 10
        while not results:
            assert time.monotonic() < end, "A's writes never failed"
            results += pre.step()
        assert [(r.request_id, r.error) for r in results] == [
            ("A", "data plane error: deadline passed before the copy started")]
        assert torch.equal(dec.engine.kv_cache[a_blocks], before), "a byte of A landed"
        out, end = None, time.monotonic() + 20
        while out is None:
            assert time.monotonic() < end, "B never finished"
            pre.step()
            for r in dec.step().finished:
                out = r.output_token_ids
        assert out == reference
        assert dec.quarantined_blocks() == 0 and dec.transport.stats["overwritten"] == 0
    finally:
        gate.set()


@pytest.mark.timeout(90)
def test_a_copy_stalled_past_the_deadline_lands_in_fenced_blocks_while_other_requests_run(
        workers, llama_dir: Path, monkeypatch) -> None:
    """The fence's case: A's copy starts in time, then stalls (its first chunk waits)
    past A's deadline and any grace. A falls back to a local prefill in new blocks at
    once, and B runs meanwhile, neither in A's reserved blocks. The copy then lands,
    in blocks nobody holds; P confirms and they come back. Both answers equal the
    colocated engine's; the landing is reported as into fenced blocks, none in use."""
    params_a = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    llm = LLM(str(llama_dir), num_kv_blocks=80)
    ref_a, ref_b = (o.token_ids for o in llm.generate([PROMPT_A, PROMPT_B], [params_a, GREEDY_B], use_tqdm=False))
    gate, stalled, landed = threading.Event(), threading.Event(), []
    real = shm._copy_chunk

    def stalled_chunk(to, frm) -> None:
        if stalled.is_set():
            real(to, frm)
            return
        stalled.set()  # A's first write's copy: it waits, then lands
        gate.wait(30)
        real(to, frm)
        landed.append(time.time())

    monkeypatch.setattr(shm, "_copy_chunk", stalled_chunk)
    dec, pre = workers(dec_blocks=12)  # A's reservation (3), A again (3), B (4)
    finished: dict[str, list[int]] = {}

    def steps(seconds: float) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            pre.step()
            finished.update((r.request_id, r.output_token_ids) for r in dec.step().finished)
            time.sleep(0.005)

    try:
        rp = dec.add_request("A", PROMPT_A, params_a, remote=True, sender="prefill")
        reserved = rp.block_ids[rp.first_block:3]
        pre.submit(rp)
        end = time.monotonic() + 10
        while not stalled.is_set():
            assert time.monotonic() < end, "A's copy never started"
            pre.step()
            dec.step()
        dec.add_request("B", PROMPT_B, GREEDY_B, remote=False)
        steps(0.1)
        b_blocks = set(dec.engine.block_ids("B"))
        steps(max(0.0, rp.deadline + 0.5 - time.time()))  # past A's deadline + cancel_grace_s
        assert dec.stats["fallbacks"] == 1 and dec.quarantined_blocks() == 3
        assert not set(dec.engine.block_ids("A")) & set(reserved), "A fell back into blocks still fenced"
        assert not b_blocks & set(reserved), "B got blocks a write could still land in"
        steps(0.5)
        assert set(finished) == {"A", "B"} and not landed, "the stalled copy landed early: the test proves nothing"

        gate.set()  # the copy lands now, long after the deadline
        end = time.monotonic() + 10
        while dec.quarantined_blocks():
            assert time.monotonic() < end, "A's fenced blocks never came back"
            steps(0.01)
        assert landed and min(landed) > rp.deadline + pre.transport.config.cancel_grace_s
        assert finished == {"A": ref_a, "B": ref_b}
        # D heard of the landing (in blocks still fenced), and no request was hurt.
        assert dec.transport.stats["overwritten"] == 1 and dec.transport.stats["overwritten_in_use"] == 0
        assert not dec.corrupted
        assert dec.engine.stats().free_blocks == dec.engine.stats().num_blocks  # nothing leaked
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
        decode.expect("a", 1, list(range(16)), deadline=deadline, sender="prefill")
        prefill.write("decode", "a", 1, list(range(16)), list(range(16)), deadline=deadline)
        failed, end = [], time.monotonic() + 10
        while not failed:
            assert time.monotonic() < end, "the write never ended"
            sent, _ = poll_both(prefill, decode, 0.01)
            assert not [e for e in sent if isinstance(e, WriteDone)]
            failed += [e for e in sent if isinstance(e, WriteFailed)]
        # D's expiry cancels it first (a cancel reaches the sender at once); the copy
        # stops all the same, by its own bound.
        assert failed[0].reason.startswith("copy stopped after ") or failed[0].reason == "cancelled"
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
        decode.expect("a", 1, [2, 3], deadline=deadline, sender="prefill")
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
def test_a_stopped_copy_whose_first_chunk_landed_late_is_confirmed_only_after_it_landed(monkeypatch) -> None:
    """The first chunk starts before the deadline but lands well after deadline +
    cancel_grace_s; the copy then stops before the next chunk. D aborted the
    reservation meanwhile: it must release the blocks only after those bytes landed
    (P's cancel_ack), and hears of them as landed in fenced blocks."""
    decode, prefill = agent("shm", "decode", grace_s=0.2), agent("shm", "prefill", grace_s=0.4)
    real = torch._foreach_copy_
    calls, landed = [], []

    def first_chunk_slow(to, frm) -> None:
        calls.append(time.time())
        if len(calls) == 1:
            time.sleep(0.8)  # lands past deadline + either side's grace
        real(to, frm)
        landed.append(time.time())

    monkeypatch.setattr(shm, "CHUNK_BYTES", 1, raising=False)  # one block per chunk
    monkeypatch.setattr(shm, "_copy_chunk", first_chunk_slow, raising=False)
    try:
        prefill.kv_cache[:4].fill_(PAYLOAD)
        prefill.add_peer(decode.metadata())
        deadline = time.time() + 0.1
        decode.expect("a", 1, [0, 1, 2, 3], deadline=deadline, sender="prefill")
        prefill.write("decode", "a", 1, [0, 1, 2, 3], [0, 1, 2, 3], deadline=deadline)
        decode.abort("a")
        sent, received, end = [], [], time.monotonic() + 10
        while not [e for _, e in received if isinstance(e, Released)]:
            assert time.monotonic() < end, f"never released: sent {sent}, received {received}"
            more_sent, more_received = poll_both(prefill, decode, 0.01)
            sent += more_sent
            received += [(time.time(), e) for e in more_received]
        released_at = next(t for t, e in received if isinstance(e, Released))
        assert landed and max(landed) < released_at
        assert [(type(e), e.reason) for e in sent] == [(WriteFailed, "cancelled")]
        assert bool((decode.kv_cache[0] == PAYLOAD).all()) and bool((decode.kv_cache[1:4] == SENTINEL).all())
        # D heard of the landing while the blocks were still fenced (its contents are
        # unknown: part of a write), and only then released them.
        assert [e for _, e in received if isinstance(e, Overwritten)] == [Overwritten("a", 1, (0, 1, 2, 3), True)]
        assert decode.stats["overwritten_in_use"] == 0
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
    """The alarm behind the fence: the receiver's fence is broken by force (released with
    a copy still to land), the copy then lands: the receiver refuses the write, and
    reports Overwritten naming the blocks. Also when the sender cancelled the write
    meanwhile: its bytes landed all the same, and the receiver must hear of them."""
    decode, prefill = agent("shm", "decode", grace_s=0.2), agent("shm", "prefill")
    gate, pool = threading.Event(), ThreadPoolExecutor(2)
    try:
        prefill.kv_cache[:2].fill_(PAYLOAD)
        gated_start(prefill, gate, pool)
        prefill.add_peer(decode.metadata())
        decode.expect("a", 1, [2, 3, 5], deadline=time.time() + 0.2, sender="prefill")
        prefill.write("decode", "a", 1, [0, 1], [2, 3], deadline=time.time() + 0.2)
        if cancelled:
            prefill.cancel("a")
        decode.abort("a")
        received = poll_both(prefill, decode, 0.3)[1]
        assert not [e for e in received if isinstance(e, Released)], "released while the copy could still land"
        decode.receiving.release("a", 1)  # a broken fence, as a transport with a bug would have
        received = poll_both(prefill, decode, 0.01)[1]
        assert Released("a", 1, (2, 3, 5)) in received

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
        # Cancelled (by the sender, or D's abort reached it first), or refused by D.
        assert sent[0].reason == "cancelled" or "already released" in sent[0].reason, sent[0].reason
        assert decode.stats["overwritten"] == decode.stats["overwritten_in_use"] == 1
    finally:
        gate.set()
        pool.shutdown(wait=True)
        prefill.close()
        decode.close()


@pytest.mark.timeout(60)
@pytest.mark.skipif(not hasattr(EngineCore, "invalidate_blocks"),
                    reason="needs EngineCore.invalidate_blocks (engine/ adds it)")
def test_the_decode_worker_fails_the_requests_holding_overwritten_blocks(workers) -> None:
    """The alarm behind the fence, in the decode worker: A's fence broken by force, B
    prefilled into the blocks A had, A's copy landing then: B is aborted and listed in
    DecodeWorkerCore.corrupted."""
    dec, pre = workers()
    gate, pool = threading.Event(), ThreadPoolExecutor(2)
    try:
        gated_start(pre.transport, gate, pool)
        start_and_abort_a(dec, pre)
        epoch = next(iter(dec.transport.receiving.quarantine))[1]
        dec.transport.receiving.release("A", epoch)  # a broken fence, by force
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
