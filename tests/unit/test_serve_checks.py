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


def test_a_draft_model_that_cannot_serve_is_refused_before_any_worker_starts(llama_dir: Path, tmp_path: Path,
                                                                            monkeypatch) -> None:
    """decode.engine.speculative_config.model is checked as the engine would check it,
    before the workers load (else each decode worker fails the same way, late)."""
    import cluster.serve as serve_module

    monkeypatch.setattr(serve_module, "launcher_for", lambda config: pytest.fail("a worker was started"))

    def config(model: str, **engine) -> ClusterConfig:
        spec = {"model": model, "num_speculative_tokens": 3}
        return ClusterConfig.from_dict({"model": str(llama_dir), "prefill": {"replicas": 0},
                                        "decode": {"engine": {"speculative_config": spec, **engine}}})

    with pytest.raises(ValueError, match=r"^decode\.engine\.speculative_config\.model '/nowhere' does not load"):
        build(config("/nowhere"))
    other = json.loads((llama_dir / "config.json").read_text())
    (tmp_path / "small").mkdir()
    (tmp_path / "small" / "config.json").write_text(json.dumps({**other, "vocab_size": 500}))
    with pytest.raises(ValueError, match=r"vocabulary of 500 tokens, the target model 384"):
        build(config(str(tmp_path / "small")))
    (tmp_path / "short").mkdir()
    (tmp_path / "short" / "config.json").write_text(json.dumps({**other, "max_position_embeddings": 64}))
    with pytest.raises(ValueError, match=r"supports 64 positions .* fewer than the target's max_model_len"):
        build(config(str(tmp_path / "short")))
    check_servable(config(str(tmp_path / "short"), max_model_len=64))  # within its context: fine
