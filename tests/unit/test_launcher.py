"""launcher_for picks each config.launcher's class, which offers the whole interface;
Ray is imported only when its launcher is picked, and cluster/ray/ never shadows it."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from cluster.config import LAUNCHERS, load_cluster_config
from cluster.launcher import LAUNCHER_CLASSES, launcher_for

REPO = Path(__file__).resolve().parents[2]
VERBS = ("check", "start", "supervise", "serve", "down")


@pytest.mark.parametrize("name", LAUNCHERS)
def test_every_config_launcher_has_a_class_with_every_verb(name: str) -> None:
    assert set(LAUNCHER_CLASSES) == set(LAUNCHERS)
    config = dataclasses.replace(load_cluster_config(REPO / "configs" / "local.yaml"), launcher=name)
    launcher = launcher_for(config)
    assert all(callable(getattr(launcher, verb, None)) for verb in VERBS)
    assert (launcher.restarts_workers, launcher.detachable) == ((True, True) if name == "ray" else (False, False))


def test_ray_is_imported_only_for_the_ray_launcher_and_is_ray_itself() -> None:
    script = (
        "import dataclasses, sys\n"
        "from cluster.config import load_cluster_config\n"
        "from cluster.launcher import launcher_for\n"
        "config = load_cluster_config('configs/local.yaml')\n"
        "launcher_for(config)\n"
        "assert 'ray' not in sys.modules, 'the local launcher imported Ray'\n"
        "launcher_for(dataclasses.replace(config, launcher='ray'))\n"
        "import cluster.ray.workers as workers\n"
        "assert 'site-packages' in workers.ray.__file__, workers.ray.__file__\n")
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True,
                            env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"}, timeout=120)
    assert result.returncode == 0, result.stderr
