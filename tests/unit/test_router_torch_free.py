"""The router runs no model, so it must not load torch: importing it, and building a
Router and its app on the demo model, leave torch out of the process (each checked in
a fresh interpreter, since the test process has torch already). And the tokenizer it
loads without AutoTokenizer is the one AutoTokenizer would have given."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from engine.tokenizer import load_tokenizer, tokenizer_class_name

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "models" / "SmolLM2-135M-Instruct"


def python(code: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)


def test_importing_the_router_does_not_import_torch() -> None:
    out = python("import router.app, router.core, sys; print('torch' in sys.modules)")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


@pytest.mark.skipif(not (DEMO / "tokenizer.json").is_file(), reason="the demo model is not prepared (make model)")
def test_a_router_on_the_demo_model_does_not_load_torch() -> None:
    code = """
import sys
from router.app import Router, create_app
from cluster.config import RouterConfig
from engine.config import EngineConfig
from router.config import ModelLimits
router = Router(RouterConfig(), ModelLimits.of(EngineConfig(model=sys.argv[1])), {"decode-0": "tcp://127.0.0.1:9"})
create_app(router)
print(router.tokenizer.encode("Hello") != [], router.max_model_len > 0, "torch" in sys.modules)
"""
    out = python(code, str(DEMO))
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "True", "False"]


@pytest.mark.skipif(not (DEMO / "tokenizer.json").is_file(), reason="the demo model is not prepared (make model)")
def test_the_launchers_process_where_the_router_runs_does_not_load_torch() -> None:
    """`pdserve serve` runs the router in the launcher's process: the CLI, the local
    launcher, the worker configs it hands to the worker processes and the router it
    builds load no torch there (the workers' roles are imported in their own processes)."""
    code = """
import os, sys, types
import cluster.cli, cluster.local.launcher, cluster.local.supervisor
import cluster.local.workers as local
from cluster.config import ClusterConfig
from cluster.launcher import launcher_for
from cluster.serve import router_for

made = []

class Process:  # what spawn() hands multiprocessing, kept instead of started
    def __init__(self, target, args, name, daemon):
        self.target, self.args, self.name, self.pid = target, args, name, os.getpid()
        made.append(self)
    def start(self):
        pass

local.worker_context = lambda: types.SimpleNamespace(Pipe=lambda: (None, None), Process=Process)
config = ClusterConfig.from_dict({"model": sys.argv[1]})
launcher_for(config)
workers = [local.spawn(config, role, 0, None) for role in ("decode", "prefill")]
router_for(config, {"decode-0": "tcp://127.0.0.1:9"}, {"prefill-0": "tcp://127.0.0.1:10"})
environ, serve_worker, worker, control = made[0].args
print(worker.name, "torch" in sys.modules)
"""
    out = python(code, str(DEMO))
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["decode-0", "False"]


def test_the_tokenizer_is_the_one_autotokenizer_loads(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    def declaring(arch: str, tokenizer_class: str) -> Path:
        out = shutil.copytree(tiny_models[arch], tmp_path / f"{arch}-{tokenizer_class}")
        config = json.loads((out / "tokenizer_config.json").read_text())
        (out / "tokenizer_config.json").write_text(json.dumps({**config, "tokenizer_class": tokenizer_class}))
        return out

    # The tiny models declare the generic class; Qwen3 checkpoints declare Qwen2Tokenizer.
    known = [*tiny_models.values(), declaring("qwen3", "Qwen2TokenizerFast")]
    known += [DEMO] if (DEMO / "tokenizer.json").is_file() else []
    unknown = [declaring("llama", "GPT2TokenizerFast")]  # left to AutoTokenizer itself
    text = "Hello world, pdserve  serves! 123 Grüße 世界"
    for d in known + unknown:
        assert (tokenizer_class_name(d) is None) == (d in unknown), d
        ours, auto = load_tokenizer(str(d)), AutoTokenizer.from_pretrained(str(d))
        assert type(ours) is type(auto), d
        assert ours.encode(text) == auto.encode(text), d
