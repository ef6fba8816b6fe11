"""Which prefill worker a decode worker asks, and when it prefills locally instead."""

from __future__ import annotations

from types import SimpleNamespace

from decode_worker.server import DecodeWorker, _Client
from protocol import Peers


def fake_core(gone: list[str] | None = None) -> SimpleNamespace:
    """What DecodeWorker touches of its core outside a step."""
    waiting: set[str] = set()
    return SimpleNamespace(waiting_for_kv=waiting, is_waiting_for_kv=waiting.__contains__,
                           accepts_prompts_from=lambda name: True, stats={"fenced_refusals": 0},
                           engine=SimpleNamespace(collect_kv_events=lambda max_per_block: None),
                           transport=SimpleNamespace(peer_gone=(gone if gone is not None else []).append))


def test_least_busy_prefill_worker_then_local_when_saturated() -> None:
    core = fake_core()
    worker = DecodeWorker("decode-test", core, prefill_max_outstanding=2)
    try:
        assert worker._pick_prefill_worker() is None  # no prefill pool: local
        worker.prefill_workers = ["prefill-0", "prefill-1"]
        picks = []
        for i in range(4):
            name = worker._pick_prefill_worker()
            picks.append(name)
            worker.requests[f"r{i}"] = _Client(None, b"router", 0.0, prefill=name)
            core.waiting_for_kv.add(f"r{i}")
        assert picks == ["prefill-0", "prefill-1", "prefill-0", "prefill-1"]
        assert worker._pick_prefill_worker() is None and worker.transfer["saturated"] == 1
        core.waiting_for_kv.discard("r1")  # its KV arrived (or it fell back): a slot frees
        assert worker._pick_prefill_worker() == "prefill-1"
        assert worker.requests["r1"].prefill is None
    finally:
        worker.close()


def test_peers_updates_drop_gone_and_moved_prefill_workers() -> None:
    gone: list[str] = []
    worker = DecodeWorker("decode-test", fake_core(gone))
    try:
        worker.set_peers(Peers(prefill={"prefill-0": "tcp://127.0.0.1:1", "prefill-1": "tcp://127.0.0.1:2"}))
        assert worker.prefill_workers == ["prefill-0", "prefill-1"] and set(worker.dealers) == set(worker.prefill_workers)
        worker.set_peers(Peers(prefill={"prefill-1": "tcp://127.0.0.1:2"}))  # prefill-0 died
        assert gone == ["prefill-0"] and worker.prefill_workers == ["prefill-1"] and set(worker.dealers) == {"prefill-1"}
        worker.set_peers(Peers(prefill={"prefill-0": "tcp://127.0.0.1:3", "prefill-1": "tcp://127.0.0.1:4"}))
        # prefill-0 came back; prefill-1 moved (restarted between two probes): gone, then new
        assert gone == ["prefill-0", "prefill-1"] and worker.prefill_addresses == {
            "prefill-0": "tcp://127.0.0.1:3", "prefill-1": "tcp://127.0.0.1:4"}
        assert worker._pick_prefill_worker() == "prefill-0"
    finally:
        worker.close()
