"""`priority` end to end: the router over real HTTP in front of a real decode worker (its
loop in a thread of this process, a tiny model, one sequence at a time). While the
worker is busy, a later request of better (lower) priority runs before an earlier one.
And the router's fair-queuing tag (Generate.queue_tag): it reaches the decode worker's
engine, and, with the priority, the prefill worker's queue (RemotePrefill)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from cluster.config import ClusterConfig
from cluster.serve import router_for
from decode_worker.remote_kv import DecodeWorkerCore
from decode_worker.server import DecodeWorker
from engine.config import EngineConfig
from engine.engine_core import EngineCore
from kv_transfer import TransportConfig, create_transport
from protocol import Generate, encode
from protocol.control import Stop
from tests.disagg.test_remote_prefill import GREEDY, worker_pair
from tests.fidelity.test_hf_fidelity import random_prompts
from tests.http_server import free_port, serving
from tests.unit.test_router_http import open_request, request, wait_for
from tests.unit.test_stall_watchdog import GREEDY as GREEDY_WIRE
from tests.unit.test_stall_watchdog import Rig
from workers.control import QueueControl


@pytest.fixture
def one_seq_worker(llama_dir: Path) -> Iterator[tuple[str, EngineCore]]:
    """The router's base URL and the engine of its one decode worker, which runs one
    sequence at a time (max_num_seqs 1): the others wait in its queue."""
    transport = create_transport("tcp", "decode-0", TransportConfig())
    engine = EngineCore(EngineConfig(model=str(llama_dir), num_kv_blocks=64, max_num_seqs=1),
                        transport.allocate_kv_cache)
    transport.register_kv_cache(engine.kv_cache, "tiny-llama")
    worker = DecodeWorker("decode-0", DecodeWorkerCore(engine, transport))
    control = QueueControl()
    loop = threading.Thread(target=worker.run, args=(control,), daemon=True)
    loop.start()
    config = ClusterConfig.from_dict({"model": str(llama_dir), "prefill": {"replicas": 0}})
    try:
        with serving(router_for(config, {"decode-0": worker.address}), free_port()) as base:
            yield base, engine
    finally:
        control.to_worker(encode(Stop()))
        loop.join(10)
        transport.close()


@pytest.mark.timeout(60)
def test_a_later_request_of_better_priority_runs_first(one_seq_worker) -> None:
    base, engine = one_seq_worker
    busy = open_request(base, "POST", "/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 1000,
                                                          "ignore_eos": True, "stream": True}, 30)
    assert busy.status == 200 and busy.readline().startswith(b"data: ")  # it runs: the one slot is taken
    finished: list[str] = []

    def send(name: str, priority: int | None) -> None:
        # 16 tokens, one slot: the second to run starts 16 steps after the first ended,
        # so the order the clients hear their answers is the order they ran, even on a
        # loaded machine (at 2 tokens a late HTTP reply swapped them in a CI run).
        body = {"prompt": [8, 9, 10], "max_tokens": 16, "ignore_eos": True}
        status, out = request(base, "POST", "/v1/completions", body | ({} if priority is None else
                                                                       {"priority": priority}))
        assert status == 200, out
        finished.append(name)

    threads = []
    for name, priority, queued in (("first, default priority", None, 1), ("later, priority -1", -1, 2)):
        threads.append(threading.Thread(target=send, args=(name, priority)))
        threads[-1].start()
        wait_for(lambda queued=queued: engine.scheduler.num_waiting == queued, 10, f"{name} queued behind the busy request")
    start = time.monotonic()
    busy.close()  # its client leaves: the router aborts it and the slot comes free
    for thread in threads:
        thread.join(20)
    assert finished == ["later, priority -1", "first, default priority"], json.dumps(finished)
    assert time.monotonic() - start < 20


@pytest.mark.timeout(60)
def test_a_generates_priority_and_queue_tag_reach_the_decode_engine(llama_dir: Path) -> None:
    rig = Rig(llama_dir, stall_timeout_s=None)
    try:
        rig.send(Generate(request_id="r", prompt=[5, 6, 7], params=GREEDY_WIRE, remote=False, priority=-2,
                          queue_tag=3.5))
        request = rig.engine.scheduler.requests["r"]
        assert (request.priority, request.queue_tag) == (-2, 3.5)
    finally:
        rig.close()


@pytest.mark.timeout(120)
def test_the_prefill_worker_computes_jobs_in_priority_then_tag_order_not_arrival(llama_dir: Path) -> None:
    """Three remote prefills reach one prefill worker together: the one of best priority
    (sent last, with the highest tag) is computed first, then, within a priority, the
    lower tag, though it came later. Its token budget (24) is less than a prompt (58
    tokens to compute), so each step shows who was admitted."""
    decode, prefill = worker_pair(llama_dir, "tcp")
    try:
        sent = (("tag-5", 0, 5.0), ("tag-1", 0, 1.0), ("urgent-tag-9", -1, 9.0))
        prompts = random_prompts([59] * len(sent), seed=31)
        for (rid, priority, tag), prompt in zip(sent, prompts):
            rp = decode.add_request(rid, prompt, GREEDY, remote=True, priority=priority, sender="prefill",
                                    queue_tag=tag)
            assert rp is not None and (rp.priority, rp.queue_tag) == (priority, tag)  # D passes them on
            prefill.submit(rp)
        started: list[str] = []
        end = time.monotonic() + 60
        while decode.engine.has_unfinished() or prefill.engine.has_unfinished():
            assert time.monotonic() < end, "the remote prefills did not finish"
            for result in prefill.step():
                assert result.error is None, result
            started += [rid for rid, _, _ in sent if rid not in started and prefill.engine.computed_tokens(rid)]
            decode.step()
        assert started == ["urgent-tag-9", "tag-1", "tag-5"]
        assert prefill.stats["prefills"] == 3 and decode.stats["fallbacks"] == 0
    finally:
        decode.transport.close()
        prefill.transport.close()
