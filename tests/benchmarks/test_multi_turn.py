"""benchmarks/serving/multi_turn.py's parts that need no server: each arm's config is a
valid cluster config with the tiers it names, the conversations are drawn as documented,
the tier figures come from /metrics, and the table's medians and ratios."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.serving import multi_turn as mt
from cluster.config import load_cluster_config


def test_each_arm_is_a_valid_config_with_its_tiers(tmp_path: Path) -> None:
    args = mt.parse_args([])
    engines = {}
    for arm in mt.ARMS:
        config = load_cluster_config(str(mt.arm_config(args, arm, tmp_path)))
        engines[arm] = config.engine_config("decode")
        assert config.kv_store.enabled == (arm == "shared") and config.router.port == args.port
        assert engines[arm].kv_cache_memory_gib == args.pool_gib
    assert engines["off"].kv_offload_gib == 0 and engines["host"].kv_offload_gib == args.host_gib
    assert engines["disk"].kv_offload_dir == str(tmp_path / "decode") and engines["disk"].kv_offload_gib == args.disk_host_gib
    assert engines["shared"].kv_offload_gib == args.host_gib and engines["shared"].kv_offload_dir is None


def test_conversations_share_a_system_prompt_unless_no_reuse() -> None:
    systems, users = mt.conversations(mt.parse_args(["--conversations", "5", "--turns", "3"]))
    assert len(set(systems)) == 1 and [len(u) for u in users] == [3] * 5
    systems, users = mt.conversations(mt.parse_args(["--conversations", "5", "--no-reuse"]))
    assert len(set(systems)) == 5 and [len(u) for u in users] == [1] * 5


def test_tier_figures_come_from_the_metrics() -> None:
    text = ('pdserve_kv_tier_hits_blocks_total{role="decode",tier="host",worker="decode-0"} 3.0\n'
            'pdserve_kv_tier_hits_blocks_total{role="prefill",tier="host",worker="prefill-0"} 2.0\n'
            'pdserve_kv_tier_hits_blocks_total{role="decode",tier="shared",worker="decode-0"} 7.0\n')
    assert mt.metric_sum(text, "pdserve_kv_tier_hits_blocks_total", tier="host") == 5
    assert mt.metric_sum(text, "pdserve_kv_tier_hits_blocks_total", tier="disk") == 0
    assert mt.metric_sum(None, "pdserve_kv_tier_hits_blocks_total") == 0


def test_the_table_gives_medians_and_the_ratio_to_off() -> None:
    def run(arm: str, p50: float) -> dict:
        return {"arm": arm, "ttft": {"p50": p50, "p99": 2 * p50}, "request_throughput": 1.0,
                "token_throughput": 100.0, "cached": 0.5, "host": 0.2, "disk": 0.0, "shared": 0.1}

    rows = mt.table([run("off", 1.0), run("off", 3.0), run("off", 2.0), run("host", 0.5), run("host", 0.4),
                     run("host", 9.0)], ["off", "host"]).splitlines()
    assert rows[2].startswith("| off | 2000 | 4000 |") and rows[2].endswith("| 1.00x |")
    assert rows[3].startswith("| host | 500 |") and rows[3].endswith("| 4.00x |")


@pytest.mark.parametrize("argv,message", [(["--arms", "off,ssd"], "unknown arm 'ssd'"),
                                          (["--turns", "0"], "--turns must be >= 1"),
                                          (["--pool-gib", "0"], "--pool-gib must be > 0")])
def test_bad_options_name_the_problem(argv: list[str], message: str, capsys) -> None:
    with pytest.raises(SystemExit):
        mt.parse_args(argv)
    assert message in capsys.readouterr().err
