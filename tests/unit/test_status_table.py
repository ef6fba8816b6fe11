"""`pdserve status`'s table says which workers are live, dead or being drained."""

from __future__ import annotations

from cluster.status import format_status


def test_the_live_column_says_draining_for_a_worker_being_scaled_down() -> None:
    worker = {"address": "tcp://x", "stats": {"running": 1}}
    text = format_status({"model": "m", "in_flight": 1, "prefill_workers": [], "decode_workers": [
        {"name": "decode-0", "live": True, **worker}, {"name": "decode-1", "live": True, "draining": True, **worker},
        {"name": "decode-2", "live": False, "draining": True, **worker}]})
    rows = {line.split()[0]: line.split()[1] for line in text.splitlines() if line.startswith("decode-")}
    assert rows == {"decode-0": "yes", "decode-1": "draining", "decode-2": "NO"}
