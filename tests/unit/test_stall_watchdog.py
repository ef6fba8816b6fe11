"""Stall and hang detection (workers/loop.py) on a fake clock; the `stalled`
field of a worker's stats reply and how the router takes it; the config field."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
import zmq
import zmq.asyncio

from cluster.config import ClusterConfig, ConfigError, RouterConfig
from decode_worker.remote_kv import DecodeWorkerCore
from decode_worker.server import DecodeWorker
from engine.config import EngineConfig
from engine.engine_core import EngineCore, RequestsFailed, StepOutput
from kv_transfer import TransportConfig, create_transport
from protocol import (
    WORKER_MESSAGES,
    Abort,
    Generate,
    Message,
    Peers,
    Rejected,
    Stats,
    StatsReply,
    Tokens,
    WorkerStats,
    encode,
    mean_points,
)
from router.core import _rejection
from router.worker_client import WORKER_LOST, WorkerClient
from tests.worker_stats import worker_stats
from workers.loop import WorkerFailed, WorkerStalled
from workers.watchdog import HangWatchdog, StallWatchdog

decode = WORKER_MESSAGES.decode

GREEDY = {"max_tokens": 8, "temperature": 0.0, "ignore_eos": True}


# --- StallWatchdog --------------------------------------------------------------------

def test_pending_work_without_progress_stalls_once_at_the_timeout_then_exits_after_the_grace() -> None:
    w = StallWatchdog(timeout_s=10.0, grace_s=2.0, now=100.0)
    assert not w.observe(101.0, pending=True, progressed=False)  # the clock starts at 100
    assert w.no_progress_s(105.0) == 5.0 and not w.stalled
    assert not w.observe(109.9, pending=True, progressed=False)
    assert w.observe(110.0, pending=True, progressed=False) and w.stalled
    assert not w.observe(111.0, pending=True, progressed=False)  # reported once
    assert not w.must_exit(111.9) and w.must_exit(112.0)
    # For good: neither progress nor running out of work brings it back.
    assert not w.observe(113.0, pending=False, progressed=True)
    assert w.stalled and w.no_progress_s(113.0) == 13.0


def test_progress_or_idleness_restarts_the_clock() -> None:
    w = StallWatchdog(timeout_s=10.0, grace_s=2.0, now=0.0)
    for t in range(1, 100):  # a step every second that computes tokens: never stalled
        assert not w.observe(float(t), pending=True, progressed=True)
    assert not w.observe(105.0, pending=False, progressed=False)  # idle: nothing to advance
    assert not w.observe(200.0, pending=False, progressed=False)
    assert w.no_progress_s(200.0) == 0.0
    # Work arrives after a long idle stretch: the clock starts at the last idle look.
    assert not w.observe(200.01, pending=True, progressed=False)
    assert not w.observe(209.9, pending=True, progressed=False)
    assert w.observe(210.0, pending=True, progressed=False)


def test_a_slow_step_that_computes_tokens_is_progress() -> None:
    w = StallWatchdog(timeout_s=10.0, grace_s=2.0, now=0.0)
    assert not w.observe(0.01, pending=True, progressed=False)
    # One step took 30 s, longer than the timeout, and computed a prompt chunk.
    assert not w.observe(30.0, pending=True, progressed=True)
    assert not w.stalled and w.no_progress_s(30.0) == 0.0


@pytest.mark.parametrize("timeout", [None, 0])
def test_no_timeout_no_stall(timeout) -> None:
    w = StallWatchdog(timeout_s=timeout, grace_s=2.0, now=0.0)
    assert not w.observe(1e6, pending=True, progressed=False)
    assert not w.stalled and not w.must_exit(2e6)


# --- HangWatchdog ---------------------------------------------------------------------

def test_a_loop_that_does_not_come_round_is_hung_after_the_limit() -> None:
    h = HangWatchdog(limit_s=10.0, on_hang=lambda s: None, beat=lambda: 0, period_s=1.0)
    assert not h.check(0.0, beat=1)
    for t in range(1, 10):  # looked at every second, the loop stuck at beat 1
        assert not h.check(float(t), beat=1)
    assert h.check(10.0, beat=1)
    assert not h.check(11.0, beat=2)  # it came round: the count starts over
    for t in range(12, 21):
        assert not h.check(float(t), beat=2)
    assert h.check(21.0, beat=2)


def test_a_suspended_process_is_not_taken_for_a_hung_loop() -> None:
    h = HangWatchdog(limit_s=10.0, on_hang=lambda s: None, beat=lambda: 0, period_s=1.0)
    assert not h.check(0.0, beat=7)
    assert not h.check(1.0, beat=7)
    # SIGSTOP for a minute: the watchdog itself did not run; its count starts over.
    assert not h.check(61.0, beat=7)
    for t in range(62, 71):
        assert not h.check(float(t), beat=7)
    assert h.check(71.0, beat=7)


def test_the_hang_watchdog_thread_calls_on_hang() -> None:
    hung: list[float] = []
    h = HangWatchdog(limit_s=0.3, on_hang=hung.append, beat=lambda: 0, period_s=0.05)
    h.start()
    end = time.monotonic() + 5
    while not hung and time.monotonic() < end:
        time.sleep(0.05)
    h.stop()
    assert hung and hung[0] >= 0.3


# --- a decode worker's stats reply, and its stall ---------------------------------------

class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Rig:
    """A decode worker (real engine, tcp transport) driven in-process over its socket."""

    def __init__(self, llama_dir: Path, stall_timeout_s: float | None = 10.0, transport: str = "tcp") -> None:
        self.transport = create_transport(transport, "decode-0", TransportConfig())
        self.engine = EngineCore(EngineConfig(model=str(llama_dir), num_kv_blocks=64),
                                 self.transport.allocate_kv_cache)
        self.transport.register_kv_cache(self.engine.kv_cache, "tiny-llama")
        self.worker = DecodeWorker("decode-0", DecodeWorkerCore(self.engine, self.transport),
                                   stall_timeout_s=stall_timeout_s, stall_grace_s=2.0)
        self.clock = FakeClock()
        self.worker.clock = self.clock
        self.worker.watchdog.since = self.clock.now
        self.ctx = zmq.Context()  # its own: the worker's context ends with the worker
        self.client = self.ctx.socket(zmq.DEALER)
        self.client.setsockopt(zmq.ROUTING_ID, b"router")
        self.client.connect(self.worker.address)

    def send(self, message: Message) -> None:
        self.client.send(encode(message))
        deadline = time.monotonic() + 5
        while not self.worker.sock.poll(10):
            assert time.monotonic() < deadline
        self.worker._drain(self.worker.sock)

    def stats(self) -> WorkerStats:
        self.send(Stats(seq=1))
        assert self.client.poll(5000)
        return decode(self.client.recv()).stats

    def messages(self) -> list[dict]:
        out = []
        while self.client.poll(200):
            out.append(decode(self.client.recv()))
        return out

    def close(self) -> None:
        self.client.close(0)
        self.ctx.term()
        self.worker.close()
        self.transport.close()


@pytest.mark.timeout(60)
def test_a_worker_whose_steps_advance_nothing_reports_stalled_then_gives_up(llama_dir: Path) -> None:
    rig = Rig(llama_dir)
    w = rig.worker
    try:
        rig.send(Generate(request_id="r", prompt=[5, 6, 7, 8, 9], params=GREEDY, remote=False, priority=0))
        w.step()  # a real step: the prompt is computed, one token comes out
        w._watch()
        assert rig.messages()[0].tokens and rig.stats().stalled is False
        w.core.step = lambda: StepOutput()  # from now on steps run and advance nothing
        start = rig.clock.now
        for t in (1.0, 5.0, 9.5):
            rig.clock.now = start + t
            w.step()
            w._watch()
        stats = rig.stats()
        assert stats.stalled is False and stats.no_progress_s == pytest.approx(9.5)
        rig.clock.now = start + 10.0
        w.step()
        w._watch()  # stalled now; still answering, so that the router can read it
        stats = rig.stats()
        assert stats.stalled is True and stats.no_progress_s == pytest.approx(10.0)
        rig.clock.now = start + 12.0
        w.step()
        with pytest.raises(WorkerStalled, match="no progress for 12.0 s"):
            w._watch()
    finally:
        rig.close()


@pytest.mark.timeout(60)
def test_run_gives_up_on_a_stall_without_failing_the_requests(llama_dir: Path) -> None:
    """Through run(): the stalled worker exits (WorkerFailed) and sends its client no
    error: the router fails the request over instead."""
    rig = Rig(llama_dir)
    w = rig.worker
    try:
        rig.send(Generate(request_id="r", prompt=[5, 6, 7, 8, 9], params=GREEDY, remote=False, priority=0))
        w.core.step = lambda: StepOutput()

        class Control:
            def poll(self) -> bool:
                rig.clock.now += 1.0  # each loop iteration: one second
                return False

        with pytest.raises(WorkerFailed):
            w.run(Control())
        assert w.ctx.closed
        assert rig.messages() == []  # no rejection: a stall fails over
    finally:
        rig.close()


@pytest.mark.timeout(60)
def test_requests_waiting_for_pushed_kv_are_not_pending_work(llama_dir: Path) -> None:
    rig = Rig(llama_dir)
    w = rig.worker
    try:
        w.set_peers(Peers(prefill={"prefill-0": "tcp://127.0.0.1:9"}))  # nobody there: the KV never comes
        rig.send(Generate(request_id="remote", prompt=list(range(10, 50)), params=GREEDY, remote=True, priority=0))
        assert w.core.waiting_for_kv == {"remote"}
        assert not w.pending()
        w.step()
        assert not w.pending()
        rig.send(Generate(request_id="local", prompt=[5, 6, 7], params=GREEDY, remote=False, priority=0))
        # Queued with nothing running while a reservation is open: it may be waiting for
        # the reserved blocks, which come back by the deadline (+ cancel grace) at the latest.
        assert not w.pending()
        w.step()
        assert "local" in [r.request_id for r in w.core.engine.scheduler.running] and w.pending()
        w.core.transport.abort("remote")  # its blocks are back (tcp: released at once)
        w.core.engine.abort(["local"])
        rig.send(Generate(request_id="local2", prompt=[5, 6, 7], params=GREEDY, remote=False, priority=0))
        assert w.pending()
    finally:
        rig.close()


@pytest.mark.timeout(60)
def test_a_queue_waiting_on_an_aborted_reservations_blocks_is_not_pending_work(llama_dir: Path) -> None:
    """A one-sided reservation whose client aborted keeps its blocks until the sender's
    cancel_ack or deadline + grace: a queue waiting for them is not stalled (it was
    taken for stalled as soon as the client went, and a healthy worker restarted)."""
    rig = Rig(llama_dir, transport="shm")
    w = rig.worker
    try:
        w.set_peers(Peers(prefill={"prefill-0": "tcp://127.0.0.1:9"}))  # nobody there: no cancel_ack
        rig.send(Generate(request_id="remote", prompt=list(range(10, 50)), params=GREEDY, remote=True, priority=0))
        rig.send(Abort(request_id="remote"))
        w.step()
        assert "remote" not in w.requests and w.core.transport.holds_reservations()  # quarantined
        rig.send(Generate(request_id="local", prompt=[5, 6, 7], params=GREEDY, remote=False, priority=0))
        assert not w.pending()
    finally:
        rig.close()


@pytest.mark.timeout(60)
def test_without_a_timeout_the_stats_say_not_stalled(llama_dir: Path) -> None:
    rig = Rig(llama_dir, stall_timeout_s=None)
    try:
        rig.send(Generate(request_id="r", prompt=[5, 6, 7], params=GREEDY, remote=False, priority=0))
        rig.worker.core.step = lambda: StepOutput()
        for _ in range(3):
            rig.clock.now += 1000.0
            rig.worker.step()
            rig.worker._watch()
        stats = rig.stats()
        assert stats.stalled is False and stats.no_progress_s == pytest.approx(3000.0)
    finally:
        rig.close()


@pytest.mark.timeout(60)
def test_the_stats_reply_carries_step_times_by_batch_size_and_by_step_tokens(llama_dir: Path) -> None:
    """What the router's latency predictor fits: one point per size bucket that saw a step."""
    rig = Rig(llama_dir, stall_timeout_s=None)
    try:
        before = rig.stats().step_seconds_by_requests
        assert before is not None and mean_points(before) == []
        rig.send(Generate(request_id="r", prompt=[5, 6, 7], params=GREEDY, remote=False, priority=0))
        rig.worker.step()  # the prompt: 1 request, 3 tokens
        assert rig.messages()[0].tokens  # read before the stats reply
        stats = rig.stats()
        by_requests, by_tokens = stats.step_seconds_by_requests, stats.step_seconds_by_tokens
        assert by_requests is not None and by_tokens is not None
        [(requests, seconds)] = mean_points(by_requests)
        assert requests == 1.0 and 0 < seconds == pytest.approx(stats.step_seconds.sum)
        assert [size for size, _ in mean_points(by_tokens)] == [3.0]
    finally:
        rig.close()


@pytest.mark.timeout(60)
def test_failed_steps_end_their_requests_and_several_in_a_row_are_fatal(llama_dir: Path) -> None:
    rig = Rig(llama_dir, stall_timeout_s=None)
    w = rig.worker
    try:
        for rid in ("a", "b", "c", "d"):
            rig.send(Generate(request_id=rid, prompt=[5, 6, 7], params=GREEDY, remote=False, priority=0))
        real_step, doomed = w.core.step, iter([["a"], ["b"], ["c"]])

        def failing_step():
            raise RequestsFailed("the model step failed (RuntimeError: device lost)", next(doomed))

        w.core.step = failing_step
        w.step()  # "a" fails alone; serving goes on
        w.core.step = real_step
        w.step()  # a step that computes tokens: the failures in a row start over
        w.core.step = failing_step
        w.step()
        w.step()  # "b", "c": two in a row
        msgs = [m for m in rig.messages() if m.kind == "rejected"]
        assert [(m.request_id, m.status) for m in msgs] == [("a", 500), ("b", 500), ("c", 500)]
        assert all("device lost" in m.error for m in msgs)
        with pytest.raises(WorkerFailed, match="3 engine steps in a row failed"):
            w.core.step = lambda: (_ for _ in ()).throw(RequestsFailed("the model step failed", ["d"]))
            w.step()
    finally:
        rig.close()


@pytest.mark.timeout(60)
def test_failures_the_requests_caused_never_count_against_the_worker(llama_dir: Path) -> None:
    """Requests whose own parameters leave nothing to sample fail alone, with a 400,
    however many in a row: three such requests brought a healthy worker down."""
    rig = Rig(llama_dir, stall_timeout_s=None)
    w = rig.worker
    try:
        for rid in ("a", "b", "c", "d"):
            rig.send(Generate(request_id=rid, prompt=[5, 6, 7], params=GREEDY, remote=False, priority=0))
        for rid in ("a", "b", "c", "d"):
            w.core.step = lambda rid=rid: (_ for _ in ()).throw(
                RequestsFailed("unusable logits", [rid], at_fault=True))
            w.step()
        assert [(m.request_id, m.status) for m in rig.messages() if m.kind == "rejected"] == \
            [("a", 400), ("b", 400), ("c", 400), ("d", 400)]
    finally:
        rig.close()


# --- the router's side ------------------------------------------------------------------

def test_the_router_declares_a_stalled_worker_dead_and_its_replies_do_not_readmit_it() -> None:
    async def scenario() -> None:
        ctx = zmq.asyncio.Context()
        fake = ctx.socket(zmq.ROUTER)
        fake.setsockopt(zmq.LINGER, 0)
        address = f"tcp://127.0.0.1:{fake.bind_to_random_port('tcp://127.0.0.1')}"
        client = WorkerClient(ctx, "decode-0", address, timeout_s=30.0)
        reader = asyncio.create_task(client.read_forever())
        queue: asyncio.Queue = asyncio.Queue()
        client.subscribe("r", queue)
        try:
            async def reply(stalled: bool) -> None:
                client.ping()
                sender, body = await asyncio.wait_for(fake.recv_multipart(), 5)
                stats = worker_stats(name="decode-0", stalled=stalled, no_progress_s=61.0 if stalled else 0.0)
                await fake.send_multipart([sender, encode(StatsReply(seq=decode(body).seq, stats=stats))])

            await reply(stalled=False)
            await asyncio.sleep(0.2)
            assert client.alive and queue.empty()
            await reply(stalled=True)
            assert await asyncio.wait_for(queue.get(), 5) is WORKER_LOST  # its request fails over
            assert not client.alive
            await reply(stalled=True)
            await asyncio.sleep(0.2)
            assert not client.alive  # a stalled reply is no sign of life
            await reply(stalled=False)  # e.g. restarted
            await asyncio.sleep(0.2)
            assert client.alive
        finally:
            reader.cancel()
            client.sock.close(0)
            fake.close(0)
            ctx.term()

    asyncio.run(asyncio.wait_for(scenario(), 30))


def test_a_stalled_workers_other_messages_during_its_grace_do_not_readmit_it() -> None:
    """A stalled worker still answers for stall_grace_s before it exits: a token batch
    (a wedged step that finally ends) or a rejection it sends then is no proof that its
    engine steps again. Routing to it would only hand new requests to a process about to
    exit. Only a stats reply that says it is not stalled (its restarted process's)
    re-admits it."""
    async def scenario() -> None:
        ctx = zmq.asyncio.Context()
        fake = ctx.socket(zmq.ROUTER)
        fake.setsockopt(zmq.LINGER, 0)
        address = f"tcp://127.0.0.1:{fake.bind_to_random_port('tcp://127.0.0.1')}"
        client = WorkerClient(ctx, "decode-0", address, timeout_s=30.0)
        reader = asyncio.create_task(client.read_forever())
        try:
            async def reply(stalled: bool) -> bytes:
                client.ping()
                sender, body = await asyncio.wait_for(fake.recv_multipart(), 5)
                stats = worker_stats(name="decode-0", stalled=stalled, no_progress_s=61.0 if stalled else 0.0)
                await fake.send_multipart([sender, encode(StatsReply(seq=decode(body).seq, stats=stats))])
                await asyncio.sleep(0.2)
                return sender

            sender = await reply(stalled=True)
            assert not client.alive
            for late in (Tokens(request_id="r", tokens=[7], finished=False, reason="", cached=0),
                         Rejected(request_id="r", error="aborted", status=500)):
                await fake.send_multipart([sender, encode(late)])
                await asyncio.sleep(0.2)
                assert not client.alive, f"a {late.kind} message re-admitted a stalled worker"
            await reply(stalled=False)  # its restarted process steps
            assert client.alive
        finally:
            reader.cancel()
            client.sock.close(0)
            fake.close(0)
            ctx.term()

    asyncio.run(asyncio.wait_for(scenario(), 30))


def test_a_rejection_maps_to_its_status() -> None:
    bad = _rejection(Rejected(request_id="r", error="max_tokens must be >= 1", status=400))
    assert (bad.status, bad.kind, bad.message) == (400, "invalid_request_error", "max_tokens must be >= 1")
    failed = _rejection(Rejected(request_id="r", error="the engine step failed", status=500))
    assert (failed.status, failed.kind) == (500, "internal_server_error")
    assert "the engine step failed" in failed.message
    odd = _rejection(Rejected(request_id="r", error="?", status=7))
    assert odd.status == 500


# --- the config field --------------------------------------------------------------------

def test_stall_timeout_config() -> None:
    assert RouterConfig.from_dict({}).stall_timeout_s == 60.0
    assert RouterConfig.from_dict({"stall_timeout_s": 0}).stall_timeout_s is None
    assert RouterConfig.from_dict({"stall_timeout_s": None}).stall_timeout_s is None
    assert RouterConfig.from_dict({"stall_timeout_s": 30}).stall_timeout_s == 30.0
    with pytest.raises(ConfigError, match=r"router.stall_timeout_s: must be a number, got '1m'"):
        RouterConfig.from_dict({"stall_timeout_s": "1m"})
    with pytest.raises(ConfigError, match=r"router.stall_timeout_s: must be >= 0, got -1"):
        RouterConfig.from_dict({"stall_timeout_s": -1})
    with pytest.raises(ConfigError, match=r"router.stall_timeout_s: must be > worker_timeout_s \(10\)"):
        ClusterConfig.from_dict({"model": "m", "router": {"stall_timeout_s": 5}})
    assert ClusterConfig.from_dict({"model": "m", "router": {"stall_timeout_s": 0}}).router.stall_timeout_s is None
