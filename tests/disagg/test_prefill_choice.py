"""Which prefill worker a decode worker asks, and when it prefills locally instead."""

from __future__ import annotations

from types import SimpleNamespace

from decode_worker.server import DecodeWorker


def test_least_busy_prefill_worker_then_local_when_saturated() -> None:
    core = SimpleNamespace(waiting_for_kv=set())
    worker = DecodeWorker("decode-test", core, prefill_max_outstanding=2)
    try:
        assert worker._pick_prefill_worker() is None  # no prefill pool: local
        worker.prefill_workers = ["prefill-0", "prefill-1"]
        picks = []
        for i in range(4):
            name = worker._pick_prefill_worker()
            picks.append(name)
            worker.prefill_of[f"r{i}"] = name
            core.waiting_for_kv.add(f"r{i}")
        assert picks == ["prefill-0", "prefill-1", "prefill-0", "prefill-1"]
        assert worker._pick_prefill_worker() is None and worker.transfer["saturated"] == 1
        core.waiting_for_kv.discard("r1")  # its KV arrived (or it fell back): a slot frees
        assert worker._pick_prefill_worker() == "prefill-1"
        assert "r1" not in worker.prefill_of
    finally:
        worker.close()
