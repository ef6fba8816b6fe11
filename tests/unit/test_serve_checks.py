"""`pdserve serve`'s checks before any worker starts (cluster/serve.py): a model directory
without a tokenizer, and a router port in use, are errors naming the problem at once,
not after every worker has spent its time loading."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest

from cluster.config import ClusterConfig
from cluster.serve import build, check_port_free, check_servable


def test_a_model_directory_without_a_tokenizer_is_refused_before_any_worker_starts(tmp_path: Path,
                                                                                    monkeypatch) -> None:
    import cluster.serve as serve_module

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    config = ClusterConfig.from_dict({"model": str(tmp_path), "load_format": "dummy"})
    monkeypatch.setattr(serve_module, "launcher_for", lambda config: pytest.fail("a worker was started"))
    with pytest.raises(ValueError, match=rf"^model '{tmp_path}' has no tokenizer \(tokenizer.json, tokenizer.model, "
                                         r"tokenizer_config.json\): the router needs one"):
        build(config)
    (tmp_path / "tokenizer.json").write_text("{}")
    check_servable(config)  # a tokenizer file: fine


def test_a_router_port_in_use_is_refused_by_name() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ValueError, match=rf"^router.port {port} on 127.0.0.1 cannot be bound: .*pass --port"):
            check_port_free("127.0.0.1", port)
    check_port_free("127.0.0.1", port)  # free again


def test_the_local_launcher_checks_the_port_before_it_starts_workers(monkeypatch) -> None:
    import cluster.serve as serve_module
    from cluster.local.launcher import LocalLauncher

    monkeypatch.setattr(serve_module, "build", lambda config: pytest.fail("workers were started"))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        config = ClusterConfig.from_dict({"model": "m", "router": {"port": taken.getsockname()[1]}})
        with pytest.raises(ValueError, match="cannot be bound"):
            LocalLauncher().serve(config, detach=False)
