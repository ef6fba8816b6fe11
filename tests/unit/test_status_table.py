"""`pdserve status`'s table says which workers are live, dead or being drained."""

from __future__ import annotations

import msgspec
import pytest

from cluster.status import format_status
from tests.worker_stats import worker_stats


def test_the_live_column_says_draining_for_a_worker_being_scaled_down() -> None:
    worker = {"address": "tcp://x", "stats": msgspec.to_builtins(worker_stats(running=1))}
    text = format_status({"model": "m", "in_flight": 1, "prefill_workers": [], "decode_workers": [
        {"name": "decode-0", "live": True, **worker}, {"name": "decode-1", "live": True, "draining": True, **worker},
        {"name": "decode-2", "live": False, "draining": True, **worker}]})
    rows = {line.split()[0]: line.split()[1] for line in text.splitlines() if line.startswith("decode-")}
    assert rows == {"decode-0": "yes", "decode-1": "draining", "decode-2": "NO"}


def test_columns_read_the_stats_fields_and_the_other_roles_show_a_question_mark() -> None:
    decode = msgspec.to_builtins(worker_stats(running=2, num_blocks=200, free_blocks=150, remote=7, ranks=[11, 12]))
    text = format_status({"model": "m", "in_flight": 0, "decode_workers": [
        {"name": "decode-0", "live": True, "address": "tcp://x", "stats": decode},
        {"name": "decode-1", "live": False, "address": "tcp://y", "stats": None}]})
    rows = {line.split()[0]: line.split() for line in text.splitlines() if line.startswith("decode-")}
    # worker live address stats_age tp running waiting waiting_kv kv_used remote local ...
    assert rows["decode-0"][3:10] == ["0s", "2:11,12", "2", "0", "?", "25.0%", "7"]
    assert rows["decode-1"][3] == "never" and set(rows["decode-1"][4:]) == {"?"}  # it never answered


def test_figures_of_an_earlier_reply_show_their_age() -> None:
    """A worker busy in a long step answers /status's ask too late: its row shows the
    figures of its latest reply, and how old they are."""
    decode = msgspec.to_builtins(worker_stats(running=5))
    text = format_status({"model": "m", "in_flight": 5, "decode_workers": [
        {"name": "decode-0", "live": True, "address": "tcp://x", "stats": decode, "stats_age_s": 3.4}]})
    row = next(line.split() for line in text.splitlines() if line.startswith("decode-0"))
    assert row[3:6] == ["3s", "?", "5"]


def test_stats_this_pdserve_cannot_read_are_refused_naming_the_worker_and_field() -> None:
    stats = msgspec.to_builtins(worker_stats())
    stats["running"] = "many"
    with pytest.raises(ValueError, match=r"worker 'decode-0'.*Expected `int`, got `str` - at `\$.running`"):
        format_status({"model": "m", "in_flight": 0, "decode_workers": [
            {"name": "decode-0", "live": True, "address": "tcp://x", "stats": stats}]})


def test_the_kv_tiers_column_shows_each_tiers_usage_and_hits() -> None:
    from protocol.stats import KVTierStats, TierUsage

    tiers = KVTierStats(tiers=[TierUsage(name="host", capacity_blocks=1456, used_blocks=120, hits=34),
                               TierUsage(name="shared", capacity_blocks=2900, used_blocks=800, hits=10)],
                        offloaded_bytes=0, loaded_bytes=0, loads=0, load_seconds=0.0, failed_loads=0,
                        dropped_blocks=0)
    with_tiers = msgspec.to_builtins(worker_stats(kv_tiers=tiers))
    text = format_status({"model": "m", "in_flight": 0, "prefill_workers": [
        {"name": "prefill-0", "live": True, "address": "tcp://p", "stats": with_tiers}], "decode_workers": [
        {"name": "decode-0", "live": True, "address": "tcp://x", "stats": msgspec.to_builtins(worker_stats())}]})
    rows = {line.split()[0]: line.split() for line in text.splitlines() if line.startswith(("decode-", "prefill-"))}
    assert rows["prefill-0"][-1] == "host:120/1456+34,shared:800/2900+10"
    assert rows["decode-0"][-1] == "-"
