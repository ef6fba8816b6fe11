"""The Makefile, dry-run (`make -n`: nothing runs): the demo model's directory follows
$PDSERVE_MODELS_DIR in every target, and torch comes from the CPU wheel index where no
NVIDIA GPU is present."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CPU_INDEX = "https://download.pytorch.org/whl/cpu"

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="no make on this machine")


def dry_run(*args: str, **env: str) -> list[str]:
    # The caller's own settings of the variables under test would override what each case sets.
    ignored = ("PDSERVE_MODELS_DIR", "TORCH_INDEX", "NVIDIA_GPU", "MAKEFLAGS", "MAKELEVEL")
    environ = {k: v for k, v in os.environ.items() if k not in ignored}
    out = subprocess.run(["make", "-n", "-B", *args], cwd=REPO, env={**environ, **env}, capture_output=True,
                         text=True, timeout=60, check=True)
    return out.stdout.splitlines()


def test_every_target_uses_the_models_dir_it_is_given(tmp_path: Path) -> None:
    models = str(tmp_path / "elsewhere")
    lines = dry_run("model", "serve", "generate", "bench", PDSERVE_MODELS_DIR=models)
    commands = {target: [line for line in lines if marker in line] for target, marker in [
        ("model", "model prepare"), ("serve", "pdserve serve"), ("generate", "pdserve generate"),
        ("bench", "benchmarks.offline offline_throughput")]}
    assert all(len(found) == 1 for found in commands.values()), commands
    for target in ("serve", "generate", "bench"):
        assert f"--model {models}/SmolLM2-135M-Instruct" in commands[target][0], commands[target][0]
    assert f"--models-dir {models}" in commands["model"][0]
    assert not [line for line in lines if re.search(r"(^|[ =])models/", line)], lines
    # Unset: the repository's models/, where `pdserve model prepare` puts it by default.
    assert "--model models/SmolLM2-135M-Instruct" in next(line for line in dry_run("serve") if "pdserve serve" in line)


def torch_line(**variables: str) -> str:
    lines = dry_run(".venv/.installed", *(f"{k}={v}" for k, v in variables.items()))
    (line,) = [line for line in lines if "torch==2.13.0" in line]
    return line


def test_torch_comes_from_the_cpu_index_without_an_nvidia_gpu() -> None:
    assert torch_line(NVIDIA_GPU="").endswith(f"torch==2.13.0 --extra-index-url {CPU_INDEX}")
    assert torch_line(NVIDIA_GPU="yes").endswith("torch==2.13.0")  # pip's own index: the CUDA build
    assert torch_line(NVIDIA_GPU="", TORCH_INDEX="").endswith("torch==2.13.0")
    cuda = "https://download.pytorch.org/whl/cu130"
    assert torch_line(TORCH_INDEX=cuda).endswith(f"torch==2.13.0 --extra-index-url {cuda}")
    # Unset, NVIDIA_GPU is what this machine has.
    has_gpu = shutil.which("nvidia-smi") is not None or os.path.exists("/dev/nvidia0")
    assert (CPU_INDEX in torch_line()) is not has_gpu
