"""The KV transport's settings from the YAML file (`transport_options`): validated with
their path, and what each worker's transport is built with."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from cluster.config import ClusterConfig, ConfigError, TransportOptions, load_cluster_config
from cluster.worker_configs import worker_config
from kv_transfer import TransportConfig
from security import DeploymentSecret
from workers.start import engine_and_transport

BASE = {"model": "m", "prefill": {"replicas": 1}, "decode": {"replicas": 1}}


def test_absent_means_the_transports_own_defaults() -> None:
    options = ClusterConfig.from_dict(BASE).transport_options
    assert options == TransportOptions.from_dict({})
    defaults = TransportConfig()
    assert {f.name: getattr(defaults, f.name) for f in dataclasses.fields(TransportOptions)} == \
        dataclasses.asdict(options)
    assert ClusterConfig.from_dict(BASE).transport_config("10.0.0.2") == TransportConfig(host="10.0.0.2")


@pytest.mark.parametrize("options,message", [
    ({"timeout_s": 0}, "transport_options.timeout_s: must be > 0, got 0"),
    ({"cancel_grace_s": -1}, "transport_options.cancel_grace_s: must be > 0, got -1"),
    ({"timeout_s": "10"}, "transport_options.timeout_s: must be a number, got '10'"),
    ({"progress_thread": "no"}, "transport_options.progress_thread: must be true or false, got 'no'"),
    ({"stream": "layers"}, "transport_options.stream: must be one of ('off', 'chunk', 'layer'), got 'layers'"),
    ({"stream_layers": 0}, "transport_options.stream_layers: must be"),
    ({"stream_layers": 1.5}, "transport_options.stream_layers: must be"),
    ({"stream": True}, "transport_options.stream: must be a string, got True"),
    ({"stream_min_tokens": -1}, "transport_options.stream_min_tokens: must be"),
    ({"stream_min_tokens": 2.5}, "transport_options.stream_min_tokens: must be"),
    ({"host": "0.0.0.0"}, "transport_options.host: unknown key"),  # each worker's own node address
    ({"grace_s": 1}, "transport_options.grace_s: unknown key"),
])
def test_mistakes_are_named_with_their_path(options: dict, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        ClusterConfig.from_dict({**BASE, "transport_options": options})
    assert message in str(err.value)


def test_a_yaml_value_reaches_each_workers_transport(tmp_path: Path, llama_dir: Path) -> None:
    """Through the function every worker (local process or Ray actor) builds its
    transport with, for both pools."""
    path = tmp_path / "cluster.yaml"
    path.write_text(f"model: {llama_dir}\ntransport: tcp\n"
                    "transport_options: {timeout_s: 3.5, cancel_grace_s: 7, progress_thread: true, stream: off, "
                    "stream_min_tokens: 512, stream_layers: 3}\n"
                    "prefill: {engine: {num_kv_blocks: 8}}\ndecode: {engine: {num_kv_blocks: 8}}\n")
    config = load_cluster_config(path)
    for role in ("prefill", "decode"):
        secret = DeploymentSecret.new()
        worker = worker_config(config, role, 0, host="127.0.0.1", secret=secret)
        _, transport = engine_and_transport(worker)
        try:
            assert worker.name == f"{role}-0"
            assert transport.config == TransportConfig(timeout_s=3.5, cancel_grace_s=7.0, host="127.0.0.1",
                                                       progress_thread=True, stream="off", stream_min_tokens=512,
                                                       stream_layers=3)
            assert worker.secret is transport.config.secret is secret
        finally:
            transport.close()


def test_layer_streaming_needs_a_tp1_prefill_pool(llama_dir: Path) -> None:
    """Each rank of a TP prefill worker computes its layers in its own process, where the
    writer cannot see them: refused, naming the way out. The decode pool's TP is free."""
    pools = {"prefill": {"replicas": 1, "engine": {"tensor_parallel_size": 2}}, "decode": {"replicas": 1}}
    with pytest.raises(ConfigError, match=r"transport_options.stream: layer needs "
                                          r"prefill.engine.tensor_parallel_size 1 .* use chunk"):
        ClusterConfig.from_dict({"model": str(llama_dir), **pools, "transport_options": {"stream": "layer"}})
    ClusterConfig.from_dict({"model": str(llama_dir), **pools, "transport_options": {"stream": "chunk"}})
    swapped = {"prefill": pools["decode"], "decode": pools["prefill"]}
    ClusterConfig.from_dict({"model": str(llama_dir), **swapped, "transport_options": {"stream": "layer"}})
