"""The fence (issue 34): the blocks of a reservation the receiver gave up on come back
only when the sender confirms (cancel_ack) or its process is gone, never on a timer; a
sender that lives but never answers (SIGSTOP) holds them for as long as it lives, and
the decode worker sends it no new prompt once that would starve its pool; and a step
never reads a fenced block."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from decode_worker.remote_kv import QUARANTINE_LIMIT, DecodeWorkerCore
from engine import SamplingParams
from engine.config import EngineConfig
from engine.engine_core import EngineCore
from engine.errors import EngineStateError
from kv_transfer import KVTransport, Released, TransportConfig, create_transport
from kv_transfer.liveness import ProcessId, is_gone, this_process
from prefill_worker.remote_prefill import PrefillWorkerCore
from tests.kv_transfer.conftest import RemoteAgent
from tests.kv_transfer.test_transports import drain, local_agent

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
    receiver, _ = stopped_sender
    assert not released(drain(receiver, 0.5))
    # A restarted sender under the same name (the stopped one still exists): it knows
    # nothing of the old writes and confirms at once, but it is not the writer.
    other = RemoteAgent("shm", "prefill", seed=2, local=receiver)
    agents.append(other)
    other.call("add_peer", meta=receiver.metadata())
    other.call("poll", seconds=1.2)
    assert not released(drain(receiver, 0.2) + other.local_events)
    assert receiver.quarantined_blocks() == 2


# ------------------------------------------------------------------------------ decode worker

@pytest.fixture
def pair(llama_dir: Path) -> Iterator:
    made: list[KVTransport] = []

    def make(dec_blocks: int = 24) -> tuple[DecodeWorkerCore, PrefillWorkerCore]:
        config = TransportConfig(timeout_s=5.0, cancel_grace_s=0.2)
        t_dec, t_pre = create_transport("shm", "decode", config), create_transport("shm", "prefill", config)
        made.extend((t_dec, t_pre))
        dec = EngineCore(EngineConfig(model=str(llama_dir), num_kv_blocks=dec_blocks), t_dec.allocate_kv_cache)
        pre = EngineCore(EngineConfig(model=str(llama_dir), num_kv_blocks=80), t_pre.allocate_kv_cache)
        for t, core in ((t_dec, dec), (t_pre, pre)):
            t.register_kv_cache(core.kv_cache, "tiny-llama")
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
