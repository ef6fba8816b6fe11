"""The YAML cluster config: the shipped one loads, and every mistake names its path."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from cluster.config import ClusterConfig, ConfigError, load_cluster_config
from tests.unit.test_fp8_weights import fp8_checkpoint

REPO = Path(__file__).resolve().parents[2]


def test_local_config_loads() -> None:
    cfg = load_cluster_config(REPO / "configs" / "local.yaml")
    assert load_cluster_config(REPO / "configs" / "local-colocated.yaml").decode.replicas == 2
    moe = load_cluster_config(REPO / "configs" / "local-moe.yaml").engine_config("decode")
    assert (moe.tensor_parallel_size, moe.enable_expert_parallel, moe.load_format) == (2, True, "dummy")
    assert cfg.transport == "shm" and cfg.prefill.replicas == 1 and cfg.decode.replicas == 1
    decode = cfg.engine_config("decode")
    assert decode.model == "models/SmolLM2-135M-Instruct" and decode.max_num_seqs == 64


BASE = {"model": "m", "prefill": {"replicas": 1}, "decode": {"replicas": 1}}


@pytest.mark.parametrize("change,message", [
    ({"decode": {"replicas": 0}}, "decode.replicas: must be >= 1, got 0"),
    ({"prefill": {"replicas": -1}}, "prefill.replicas: must be >= 0, got -1"),
    ({"decode": {"replicas": "two"}}, "decode.replicas: must be an integer, got 'two'"),
    ({"router": {"policy": "random"}}, "router.policy: must be one of"),
    ({"router": {"port": 70000}}, "router.port: must be <= 65535, got 70000"),
    ({"router": {"prot": 8000}}, "router.prot: unknown key"),
    ({"transport": "carrier-pigeon"}, "transport: must be one of"),
    ({"transport": "cuda_ipc"}, "transport: 'cuda_ipc' needs device cuda"),
    ({"device": "cuda", "transport": "shm"}, "transport: 'shm' moves CPU caches"),
    ({"dtype": "float8"}, "dtype: must be one of"),
    ({"decode": {"engine": {"max_num_seqs": 0}}}, "decode.engine: max_num_seqs must be >= 1, got 0"),
    ({"decode": {"engine": {"max_num_seq": 8}}}, "decode.engine: unknown engine option(s) ['max_num_seq']"),
    ({"prefill": {"engine": {"model": "other"}}}, "prefill.engine.model: is set once, at the top"),
    ({"pools": {}}, "pools: unknown key"),
    ({"router": {"health_interval_s": 0}}, "router.health_interval_s: must be > 0, got 0"),
    ({"router": {"worker_timeout_s": "10s"}}, "router.worker_timeout_s: must be a number, got '10s'"),
    ({"router": {"health_interval_s": 2, "worker_timeout_s": 1}},
     "router.worker_timeout_s: must be > health_interval_s (2)"),
    ({"local": {"max_restarts": -1}}, "local.max_restarts: must be >= 0, got -1"),
    ({"local": {"max_restarts": "3"}}, "local.max_restarts: must be an integer, got '3'"),
    ({"local": {"restarts": 3}}, "local.restarts: unknown key"),
    ({"kv_store": {"enabled": True}}, "kv_store.enabled: no pool has a host tier"),
    # Under Ray too (its launcher starts the store as an actor): only the host tier is missing.
    ({"kv_store": {"enabled": True}, "launcher": "ray"}, "kv_store.enabled: no pool has a host tier"),
    ({"kv_store": {"enabled": True}, "launcher": "ray", "ray": {"address": "ray://head:10001"}},
     "kv_store.enabled: the Ray launcher starts the store on its own node"),
    ({"kv_store": {"capacity_gib": 0}}, "kv_store.capacity_gib: must be > 0, got 0"),
    ({"kv_store": {"fetch_timeout_s": "1s"}}, "kv_store.fetch_timeout_s: must be a number"),
    ({"kv_store": {"size": 1}}, "kv_store.size: unknown key"),
    ({"kv_store": {"fetch_timeout_s": 10}}, "kv_store.fetch_timeout_s: must be <= 5 seconds, got 10"),
])
def test_mistakes_are_named_with_their_path(change: dict, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        ClusterConfig.from_dict({**BASE, **change})
    assert message in str(err.value)


def test_missing_model_and_bad_yaml(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="model: is required"):
        ClusterConfig.from_dict({"decode": {"replicas": 1}})
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [unclosed\n")
    with pytest.raises(ConfigError, match="is not valid YAML"):
        load_cluster_config(bad)
    with pytest.raises(ConfigError, match="cannot read cluster config"):
        load_cluster_config(tmp_path / "missing.yaml")
    listed = tmp_path / "list.yaml"
    listed.write_text(yaml.safe_dump([1, 2]))
    with pytest.raises(ConfigError, match="config: must be a mapping, got list"):
        load_cluster_config(listed)


def test_an_unshardable_tp_size_is_refused_before_anything_starts(llama_dir) -> None:
    base = {"model": str(llama_dir), "prefill": {"replicas": 1}}
    with pytest.raises(ConfigError, match=r"^decode.engine.tensor_parallel_size: LlamaForCausalLM cannot be "
                                          r"sharded: 4 attention heads do not divide by tensor_parallel_size 3"):
        ClusterConfig.from_dict({**base, "decode": {"replicas": 1, "engine": {"tensor_parallel_size": 3}}})
    ok = ClusterConfig.from_dict({**base, "decode": {"replicas": 1, "engine": {"tensor_parallel_size": 4}}})
    assert ok.engine_config("decode").tensor_parallel_size == 4  # 2 KV heads, replicated


def test_a_store_too_small_for_one_block_and_pools_of_other_block_sizes_are_refused(llama_dir) -> None:
    tiers = {"engine": {"kv_offload_gib": 0.01}}
    base = {"model": str(llama_dir), "prefill": {"replicas": 1, **tiers}, "decode": {"replicas": 1, **tiers}}
    with pytest.raises(ConfigError, match=r"^kv_store.capacity_gib: must hold one of the prefill pool's KV blocks "
                                          r"\(\d+ bytes\), got 1e-06 GiB \(1073 bytes\)"):
        ClusterConfig.from_dict({**base, "kv_store": {"enabled": True, "capacity_gib": 1e-6}})
    ok = ClusterConfig.from_dict({**base, "kv_store": {"enabled": True, "capacity_gib": 0.001}})
    assert ok.kv_store.enabled
    with pytest.raises(ConfigError, match=r"^prefill.engine.block_size: must equal decode.engine.block_size .* "
                                          r"got 32 and 16"):
        ClusterConfig.from_dict({**base, "prefill": {"replicas": 1, "engine": {"block_size": 32}}})


def test_pools_of_other_kv_cache_dtypes_or_weight_quantization_are_refused(llama_dir) -> None:
    fp8 = {"replicas": 1, "engine": {"kv_cache_dtype": "fp8", "quantization": "fp8"}}
    base = {"model": str(llama_dir), "prefill": fp8, "decode": fp8}
    ok = ClusterConfig.from_dict(base)
    assert ok.engine_config("decode").kv_cache_dtype == "fp8"
    with pytest.raises(ConfigError, match=r"^prefill.engine.kv_cache_dtype: must equal decode.engine.kv_cache_dtype "
                                          r".* got 'fp8' and 'auto'"):
        ClusterConfig.from_dict({**base, "decode": {"replicas": 1, "engine": {"quantization": "fp8"}}})
    with pytest.raises(ConfigError, match=r"^prefill.engine.quantization: must equal decode.engine.quantization "
                                          r".* got 'fp8' and None"):
        ClusterConfig.from_dict({**base, "decode": {"replicas": 1, "engine": {"kv_cache_dtype": "fp8"}}})
    with pytest.raises(ConfigError, match="kv_cache_dtype must be one of"):
        ClusterConfig.from_dict({**base, "decode": {"replicas": 1, "engine": {"kv_cache_dtype": "fp4"}}})
    # Compared as they take effect: "fp8" is e4m3; e5m2 is other bytes.
    ClusterConfig.from_dict({**base, "decode": {"replicas": 1, "engine": {"kv_cache_dtype": "fp8_e4m3",
                                                                         "quantization": "fp8"}}})
    with pytest.raises(ConfigError, match=r"got 'fp8' and 'fp8_e5m2'"):
        ClusterConfig.from_dict({**base, "decode": {"replicas": 1, "engine": {"kv_cache_dtype": "fp8_e5m2",
                                                                             "quantization": "fp8"}}})


def test_an_fp8_checkpoint_is_fp8_weights_whether_or_not_a_pool_says_so(llama_dir, tmp_path) -> None:
    ckpt = fp8_checkpoint(llama_dir, tmp_path / "fp8", per_tensor=False)
    base = {"model": str(ckpt), "prefill": {"replicas": 1, "engine": {"quantization": "fp8"}},
            "decode": {"replicas": 1}}
    assert ClusterConfig.from_dict(base).engine_config("decode").quantization is None


def test_expert_parallel_on_a_model_without_experts_is_refused_at_load(llama_dir) -> None:
    base = {"model": str(llama_dir), "prefill": {"replicas": 0}}
    with pytest.raises(ConfigError, match=r"^decode.engine.tensor_parallel_size: enable_expert_parallel: "
                                          r"LlamaForCausalLM has no experts"):
        ClusterConfig.from_dict({**base, "decode": {"replicas": 1, "engine": {"enable_expert_parallel": True}}})
