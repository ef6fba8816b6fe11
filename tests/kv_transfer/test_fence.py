"""The fence (issue 34): the blocks of a reservation the receiver gave up on come back
only when the sender confirms (cancel_ack) or its process is gone, never on a timer; a
sender that lives but never answers (SIGSTOP) holds them for as long as it lives, and
the decode worker sends it no new prompt once that would starve its pool; and a step
never reads a fenced block."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import kv_transfer.shm as shm
from decode_worker.remote_kv import QUARANTINE_LIMIT, DecodeWorkerCore
from decode_worker.server import DecodeWorker
from engine import SamplingParams
from engine.config import EngineConfig
from engine.engine_core import EngineCore
from engine.errors import EngineStateError
from kv_transfer import (
    Completed,
    KVTransport,
    Overwritten,
    Released,
    TransportConfig,
    WriteDone,
    WriteFailed,
    create_transport,
)
from kv_transfer.liveness import ProcessId, is_gone, this_process
from prefill_worker.remote_prefill import PrefillWorkerCore
from protocol import PrefillDone
from tests.kv_transfer.agent import poll_both
from tests.kv_transfer.conftest import RemoteAgent
from tests.kv_transfer.test_transports import UNDER_TEST, drain, local_agent, source_cache

PROMPT = list(range(3, 43))  # 40 tokens: 3 blocks of 16 to write
GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


def released(events: list) -> list[tuple[str, tuple[int, ...]]]:
    return [(e.req, e.blocks) for e in events if isinstance(e, Released)]


# ------------------------------------------------------------------------------ liveness

def test_a_process_is_named_by_pid_and_start_time() -> None:
    me = this_process()
    assert me.pid == os.getpid() and me.start > 0 and me.boot and me.pidns
    assert is_gone(me) is False
    assert is_gone(ProcessId(me.pid, me.start + 1, me.boot, me.pidns)) is True  # the pid, reused
    assert is_gone(ProcessId(me.pid, me.start, "another-host", me.pidns)) is None  # cannot be told here
    assert is_gone(ProcessId(me.pid, me.start, me.boot, me.pidns + 1)) is None


def test_a_process_whose_name_is_not_utf8_is_still_read() -> None:
    # A name with a cut UTF-8 sequence, and the parentheses the parser must skip.
    child = subprocess.Popen([sys.executable, "-c", "import time; open('/proc/self/comm', 'wb').write("
                              "b'pd\\xc3) (x'); time.sleep(30)"])
    try:
        end = time.monotonic() + 10
        while b"\xc3" not in open(f"/proc/{child.pid}/comm", "rb").read():
            assert time.monotonic() < end, "the child never renamed itself"
            time.sleep(0.01)
        stat = open(f"/proc/{child.pid}/stat", "rb").read()
        start = int(stat[stat.rfind(b")") + 2:].split()[19])
        me = this_process()
        assert is_gone(ProcessId(child.pid, start, me.boot, me.pidns)) is False
        child.kill()
        child.wait()
        assert is_gone(ProcessId(child.pid, start, me.boot, me.pidns)) is True
    finally:
        child.kill()
        child.wait()


# ------------------------------------------------------------------------------ transport

@pytest.fixture
def stopped_sender(agents) -> Iterator[tuple[KVTransport, RemoteAgent]]:
    """A receiver whose sender (a child process) said hello and was then SIGSTOPped."""
    receiver = local_agent("shm", "decode", grace_s=0.2)
    sender = RemoteAgent("shm", "prefill", seed=1, local=receiver)
    agents.append(sender)
    sender.call("add_peer", meta=receiver.metadata())
    end = time.monotonic() + 10
    while "prefill" not in receiver.receiving.senders:
        assert time.monotonic() < end, "no hello"
        receiver.poll()
    receiver.expect("a", 1, [3, 4], deadline=time.time() + 0.3, sender="prefill")
    os.kill(sender.process.pid, signal.SIGSTOP)
    try:
        yield receiver, sender
    finally:
        if sender.process.is_alive():
            os.kill(sender.process.pid, signal.SIGCONT)
        receiver.close()


@pytest.mark.timeout(60)
def test_a_stopped_sender_keeps_the_blocks_fenced_until_it_resumes_and_confirms(stopped_sender) -> None:
    receiver, sender = stopped_sender
    events = drain(receiver, 1.5)  # past the deadline + any grace, several cancels resent
    assert [type(e).__name__ for e in events] == ["Expired"]
    assert receiver.quarantined_blocks() == 2 and receiver.holds_reservations()
    os.kill(sender.process.pid, signal.SIGCONT)
    sender.call("poll", seconds=0.3)  # it reads the cancels and confirms
    assert released(receiver.poll() + sender.local_events) == [("a", (3, 4))]
    assert receiver.quarantined_blocks() == 0


@pytest.mark.timeout(60)
def test_a_stopped_sender_that_is_killed_lifts_the_fence_without_a_word(stopped_sender) -> None:
    receiver, sender = stopped_sender
    assert not released(drain(receiver, 1.0))
    sender.kill()  # SIGKILL: no cancel_ack will ever come; its pid and start time say it is gone
    assert released(drain(receiver, 1.0)) == [("a", (3, 4))]


@pytest.mark.timeout(60)
def test_a_sender_declared_gone_while_it_still_runs_keeps_the_fence(stopped_sender) -> None:
    """A supervisor may declare a worker gone before its kill took effect: the fence
    holds while the process still exists, and lifts once it has exited."""
    receiver, sender = stopped_sender
    assert not released(drain(receiver, 0.5))
    receiver.peer_gone("prefill")
    assert not released(drain(receiver, 1.0))
    sender.kill()
    assert released(drain(receiver, 1.0)) == [("a", (3, 4))]


@pytest.mark.timeout(60)
def test_a_cancel_ack_from_another_process_of_the_same_name_is_no_proof(stopped_sender, agents) -> None:
    """A restarted sender under the same name (the stopped one still exists) knows
    nothing of the old writes and confirms at once: that does not lift the fence, the
    old process's exit (with the new one's confirmation, as it might have been sent the
    request too) does."""
    receiver, stopped = stopped_sender
    assert not released(drain(receiver, 0.5))
    other = RemoteAgent("shm", "prefill", seed=2, local=receiver)
    agents.append(other)
    other.call("add_peer", meta=receiver.metadata())
    other.call("poll", seconds=1.2)
    assert not released(drain(receiver, 0.2) + other.local_events)
    assert receiver.quarantined_blocks() == 2
    assert [key[0] for key in receiver.receiving.quarantine[("a", 1)].waiting_on] == ["prefill"]  # the old one
    stopped.kill()
    assert released(drain(receiver, 1.0)) == [("a", (3, 4))]


def stall_writes(sender: KVTransport, gate: threading.Event, req: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """`sender`'s write for request `req` stalls until `gate` is set (a stalled host, a
    wedged NIC queue), after every check the sender makes: its bytes then land late,
    through the transport's own data plane. shm: the write's copy, once started (after
    its deadline check), waits before its first chunk. nixl: the NIXL WRITE is posted
    only then."""
    if sender.name == "shm":
        real, first = shm._copy_chunk, threading.Event()

        def stalled_chunk(to, frm) -> None:
            if not first.is_set():  # the first copy is `req`'s: the test writes it first
                first.set()
                gate.wait(30)
            real(to, frm)

        monkeypatch.setattr(shm, "_copy_chunk", stalled_chunk)
        return
    start, progress = sender._start, sender._progress
    deferred: dict[int, tuple] = {}

    def stalled_start(peer, write) -> None:
        if write.req != req:
            return start(peer, write)
        deferred[write.xfer] = (peer, write)

    def stalled_progress(write) -> bool:
        if write.xfer in deferred:
            if not gate.is_set():
                return False
            start(*deferred.pop(write.xfer))
        return progress(write)

    sender._start, sender._progress = stalled_start, stalled_progress


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport", [t for t in UNDER_TEST if t in ("shm", "nixl")])
def test_a_write_stalled_past_the_deadline_lands_in_fenced_blocks_not_in_the_next_requests(
        transport: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every one-sided transport that runs on CPU: A's write stalls past A's deadline
    and any grace; D gives A up but keeps its blocks fenced; B, reserved meanwhile (the
    decode worker takes new blocks for it), is written and completes. A's bytes then
    land: in A's fenced blocks only, B's stay intact, D hears of the landing, and only
    then, on the sender's confirmation, are A's blocks released."""
    decode = local_agent(transport, "decode", grace_s=0.2)
    prefill = local_agent(transport, "prefill", grace_s=0.2)
    prefill.kv_cache.copy_(source_cache(seed=1))
    gate = threading.Event()
    try:
        prefill.add_peer(decode.metadata())
        poll_both(prefill, decode, 0.2)  # the hello, and NIXL's metadata exchange
        deadline = time.time() + 0.3
        decode.expect("a", 1, [2, 3], deadline=deadline, sender="prefill")
        stall_writes(prefill, gate, "a", monkeypatch)
        prefill.write("decode", "a", 1, [10, 11], [2, 3], deadline=deadline)
        sent, received = poll_both(prefill, decode, 1.0)  # past deadline + grace: the old timer's release
        assert [type(e) for e in received] == [type(received[0])] and type(received[0]).__name__ == "Expired"
        assert decode.quarantined_blocks() == 2
        before = decode.kv_cache[[2, 3]].clone()

        decode.expect("b", 1, [5, 6], deadline=time.time() + 60, sender="prefill")
        prefill.write("decode", "b", 1, [20, 21], [5, 6], deadline=time.time() + 60)
        sent, received = poll_both(prefill, decode, 0.5)
        assert Completed("b", 1) in received and not released(received)
        assert torch.equal(decode.kv_cache[[2, 3]], before)  # A's write has not landed yet

        gate.set()
        end, events = time.monotonic() + 10, []
        while not released(events):
            assert time.monotonic() < end, f"A's blocks never came back: {events}"
            more_sent, more_received = poll_both(prefill, decode, 0.02)
            sent += more_sent
            events += more_received
        assert torch.equal(decode.kv_cache[[2, 3]], source_cache(seed=1)[[10, 11]])  # it landed, fenced
        assert torch.equal(decode.kv_cache[[5, 6]], source_cache(seed=1)[[20, 21]])  # B untouched
        # (said once, though nixl's notice comes twice: NIXL's, and the sender's after the cancel)
        assert {e for e in events if isinstance(e, Overwritten)} == {Overwritten("a", 1, (2, 3), True)}
        assert events.index(next(e for e in events if isinstance(e, Overwritten))) < \
            events.index(next(e for e in events if isinstance(e, Released)))
        assert [type(e) for e in sent if isinstance(e, (WriteDone, WriteFailed))] == [WriteDone, WriteFailed]
        assert decode.stats["overwritten_in_use"] == 0
    finally:
        gate.set()
        prefill.close()
        decode.close()


# ------------------------------------------------------------------------------ decode worker

@pytest.fixture
def pair(llama_dir: Path) -> Iterator:
    made: list[KVTransport] = []

    def make(dec_blocks: int = 24, connect: bool = True) -> tuple[DecodeWorkerCore, PrefillWorkerCore]:
        config = TransportConfig(timeout_s=5.0, cancel_grace_s=0.2)
        t_dec, t_pre = create_transport("shm", "decode", config), create_transport("shm", "prefill", config)
        made.extend((t_dec, t_pre))
        dec = EngineCore(EngineConfig(model=str(llama_dir), num_kv_blocks=dec_blocks), t_dec.allocate_kv_cache)
        pre = EngineCore(EngineConfig(model=str(llama_dir), num_kv_blocks=80), t_pre.allocate_kv_cache)
        for t, core in ((t_dec, dec), (t_pre, pre)):
            t.register_kv_cache(core.kv_cache, "tiny-llama")
        if connect:
            t_pre.add_peer(t_dec.metadata())
        return DecodeWorkerCore(dec, t_dec, deadline_s=0.3), PrefillWorkerCore(pre, t_pre)

    yield make
    for t in made:
        t.close()


@pytest.mark.timeout(60)
def test_a_silent_prefill_worker_gets_no_new_prompt_once_its_fence_would_starve_the_pool(pair) -> None:
    """The prefill worker is never stepped (stopped): each prompt sent to it expires and
    falls back to a local prefill, its 3 blocks fenced. Past QUARANTINE_LIMIT of the
    pool (24 blocks: 6), new prompts are prefilled locally without asking it. Once it
    answers, its fences lift and it gets prompts again."""
    dec, pre = pair()
    limit = QUARANTINE_LIMIT * dec.engine.stats().num_blocks
    sent = 0
    while dec.accepts_prompts_from("prefill"):
        prompt = [t + 50 * sent for t in PROMPT]  # no prefix hits between them
        assert dec.add_request(f"r{sent}", prompt, GREEDY, remote=True, sender="prefill") is not None
        sent += 1
        end = time.monotonic() + 5
        while dec.is_waiting_for_kv(f"r{sent - 1}"):  # expires, falls back, stays fenced
            assert time.monotonic() < end
            dec.step()
    assert sent == int(limit // 3) + 1 and dec.quarantined_blocks("prefill") == 3 * sent > limit
    assert dec.add_request("late", PROMPT, GREEDY, remote=True, sender="prefill") is None
    assert dec.stats["fenced_refusals"] == 1
    end = time.monotonic() + 10
    while dec.engine.has_unfinished():  # every request ran, locally, outside the fenced blocks
        assert time.monotonic() < end
        dec.step()
    assert dec.engine.stats().free_blocks == dec.engine.stats().num_blocks - 3 * sent
    end = time.monotonic() + 10
    while dec.quarantined_blocks():  # it answers the cancels now
        assert time.monotonic() < end
        pre.step()
        dec.step()
    assert dec.engine.stats().free_blocks == dec.engine.stats().num_blocks
    assert dec.accepts_prompts_from("prefill")


@pytest.mark.timeout(60)
def test_a_step_never_reads_a_fenced_block(pair) -> None:
    """Defence at the point of use: were a fenced block ever in a scheduled request's
    table (a bookkeeping bug), the step raises instead of computing on it."""
    dec, _ = pair()
    dec.add_request("a", PROMPT, GREEDY, remote=False)
    dec.step()
    blocks = dec.engine.block_ids("a")
    dec.engine.fence_blocks(blocks[:1])
    with pytest.raises(EngineStateError, match="fenced blocks"):
        dec.engine.step()
    dec.engine.unfence_blocks(blocks[:1])
    with pytest.raises(EngineStateError, match="unfenced more often"):
        dec.engine.unfence_blocks(blocks[:1])


@pytest.mark.timeout(60)
def test_a_prefill_worker_with_no_kv_connection_refuses_and_the_blocks_come_back(pair) -> None:
    """Its handshake with this decode worker failed (a cold peer): it refuses every
    prompt before writing anything, and no cancel_ack of its could reach us. Its
    refusal names the reservation (PrefillDone.refused_epoch), which lifts the fence."""
    dec, pre = pair(connect=False)
    worker = DecodeWorker("decode-test", dec)
    try:
        rp = dec.add_request("r0", PROMPT, GREEDY, remote=True, sender="prefill")
        with pytest.raises(ValueError, match="not a peer in the session"):
            pre.submit(rp)
        worker._prefill_done("prefill", PrefillDone(request_id="r0", error="refused", refused_epoch=rp.epoch))
        end = time.monotonic() + 10
        while dec.engine.has_unfinished() or dec.quarantined_blocks():
            assert time.monotonic() < end, f"{dec.quarantined_blocks()} blocks stay fenced"
            dec.step()
        assert dec.stats["fallbacks"] == 1
        assert dec.engine.stats().free_blocks == dec.engine.stats().num_blocks
        # A refusal naming another reservation (an older one under the same id) lifts nothing.
        rp = dec.add_request("r0", PROMPT, GREEDY, remote=True, sender="prefill")
        dec.prefill_failed("r0")
        worker._prefill_done("prefill", PrefillDone(request_id="r0", error="refused", refused_epoch=rp.epoch - 1))
        assert not released(drain(dec.transport, 1.0)) and dec.transport.quarantined_blocks() == dec.quarantined_blocks() > 0
    finally:
        worker.close(0)
