"""Builds and loads pdserve's small C kernels (the CPU fast paths) with ctypes.

A kernel is one C file, compiled on first use with the system C compiler into a
per-user cache keyed by the source, the flags and the compiler, then loaded with ctypes:
no torch headers, so a build takes about a second. The libraries share torch's OpenMP
runtime (same soname, already loaded), and every call passes torch's thread count as
its team size (`omp_threads`). ctypes releases the
GIL for the call, so other Python threads of a worker keep running. Where no compiler is
found or the build fails, `load_kernel` returns None and the caller keeps its plain-torch
path.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shlex
import shutil
import subprocess
import tempfile
from ctypes import CDLL
from functools import cache
from pathlib import Path

import torch

logger = logging.getLogger(__name__)


@cache
def _cpu_flags() -> list[str]:
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    flags = next((line.split(":", 1)[1].split() for line in info.splitlines()
                  if line.startswith("flags")), [])
    return ["-mavx2", "-mfma"] if {"avx2", "fma"} <= set(flags) else []


def has_avx2_fma() -> bool:
    return bool(_cpu_flags())


def omp_threads() -> ctypes.c_int:
    """The team size every kernel passes to its OpenMP loops: torch's thread count.
    OpenMP's own default is per calling thread and, in a thread torch has not set up
    (a Ray actor's engine thread), every core."""
    return ctypes.c_int(torch.get_num_threads())


def _cache_dir() -> Path:
    root = os.environ.get("PDSERVE_KERNEL_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "pdserve", "kernels")
    return Path(root)


def _build(compiler: str, flags: list[str], source: Path, library: Path) -> None:
    library.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename: concurrent processes never see half a file.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=library.parent)
    os.close(fd)
    try:
        # $CC may carry a wrapper or options ("ccache gcc").
        result = subprocess.run([*shlex.split(compiler), *flags, str(source), "-o", tmp, "-lm"],
                                capture_output=True, text=True, timeout=120)
        if result.returncode != 0:
            raise RuntimeError(f"building {source.name} failed:\n{result.stderr}")
        os.replace(tmp, library)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def compiler() -> str | None:
    """The C compiler kernels are built with: $CC, else cc or gcc on the PATH."""
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


@cache
def load_kernel(source: Path, extra_flags: tuple[str, ...] = (), needs_avx2_fma: bool = False) -> CDLL | None:
    """The compiled `source` (a C file, with `extra_flags` for the compiler), or None
    (logged) where it cannot be built; None without a log where it `needs_avx2_fma`
    (its intrinsics) and the CPU lacks them."""
    if needs_avx2_fma and not has_avx2_fma():
        return None
    cc = compiler()
    if cc is None:
        logger.warning("no C compiler found: %s stays on the slower torch path", source.name)
        return None
    flags = ["-O3", "-shared", "-fPIC", "-fopenmp", *_cpu_flags(), *extra_flags]
    key = hashlib.sha256(source.read_bytes() + " ".join([cc, *flags]).encode()).hexdigest()[:16]
    library = _cache_dir() / f"{source.stem}_{key}.so"
    if not library.exists():
        try:
            _build(cc, flags, source, library)
        except (OSError, RuntimeError, subprocess.TimeoutExpired) as exc:
            logger.warning("%s stays on the slower torch path: %s", source.name, exc)
            return None
    return CDLL(str(library))
