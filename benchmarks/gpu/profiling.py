"""Helpers for two diagnostic sections of benchmarks/gpu_check.py (neither is in its default run).

profile: where a decode step's GPU time goes, per kernel, from torch.profiler's events.
ucx:     NIXL (UCX) transfer bandwidth under several UCX settings, each in a fresh process
         (UCX and NIXL read their environment once, at init) running benchmarks/kv/transfer.py
         through this module:

    python benchmarks/gpu/profiling.py <benchmarks/kv/transfer.py arguments>

         which is that benchmark, plus NIXL UCX backend parameters from NIXL_PARAMS_ENV.

Torch is imported inside the functions, so the command-line and parsing helpers run
without it.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

_REPO_ROOT = Path(__file__).resolve().parents[2]
_MARK = "gpu_check mode "  # record_function label that opens each mode's window in a profile

# ------------------------------------------------------------------ profile


@dataclass
class KernelStat:
    total_us: float = 0.0
    calls: int = 0


@dataclass
class StepProfile:
    """Kernels summed over `steps` profiled steps, and the unprofiled time of one step."""

    kernels: dict[str, KernelStat]
    steps: int
    wall_s: float
    replay_s: float | None = None  # CUDA-graph replay alone, where the steps replay one

    def ms(self, name: str) -> float:
        stat = self.kernels.get(name)
        return stat.total_us / 1e3 / self.steps if stat else 0.0

    def calls(self, name: str) -> float:
        stat = self.kernels.get(name)
        return stat.calls / self.steps if stat else 0.0

    def total_ms(self) -> float:
        return sum(k.total_us for k in self.kernels.values()) / 1e3 / self.steps

    def total_calls(self) -> float:
        return sum(k.calls for k in self.kernels.values()) / self.steps

    def groups(self) -> dict[str, float]:
        """ms per step in each kernel group (group_of), largest first."""
        out: dict[str, float] = {}
        for name in self.kernels:
            out[group_of(name)] = out.get(group_of(name), 0.0) + self.ms(name)
        return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def kernel_stats(events: Iterable, device: str) -> dict[str, KernelStat]:
    """Time and launches per name. On CUDA: every GPU activity (kernels, memcpy, memset),
    its duration on the GPU. On CPU: self time of each aten op, a stand-in that lets
    this table be checked without a GPU."""
    from torch.autograd import DeviceType

    on_gpu = device.startswith("cuda")
    stats: dict[str, KernelStat] = {}
    for evt in events:
        # record_function ranges are also drawn on the GPU timeline: spans, not kernels.
        if getattr(evt, "is_user_annotation", False) or evt.name.startswith(("ProfilerStep", _MARK)):
            continue
        if on_gpu:
            if evt.device_type != DeviceType.CUDA:
                continue
            us = evt.time_range.elapsed_us()
        else:
            if evt.device_type != DeviceType.CPU or evt.is_async or not evt.name.startswith("aten::"):
                continue
            us = evt.self_cpu_time_total
        stat = stats.setdefault(evt.name, KernelStat())
        stat.total_us += us
        stat.calls += 1
    return stats


def profile_modes(step: Callable[[], object], modes: list[tuple[str, Callable[[], None]]], device: str,
                  steps: int) -> tuple[dict[str, dict[str, KernelStat]], dict[str, str]]:
    """For each (name, enter) in turn: enter(), then step() `steps` times, all in ONE
    torch.profiler session (CPU and, on a GPU, CUDA activity); the events are split by
    mode at each mode's marker. One session, because starting CUPTI again in a process
    that replays CUDA graphs has crashed on some CUDA versions. Returns the stats per
    mode and, for a mode that raised (the later ones are then skipped), its error."""
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    on_gpu = device.startswith("cuda")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    errors: dict[str, str] = {}
    with profile(activities=activities) as prof:
        for name, enter in modes:
            try:
                with record_function(_MARK + name):
                    enter()
                    for _ in range(steps):
                        step()
                    if on_gpu:  # this mode's kernels end before the next mode's marker
                        torch.cuda.synchronize()
            except Exception as exc:  # noqa: BLE001 (keep the modes already profiled)
                errors[name] = f"{type(exc).__name__}: {exc}"[:150]
                break
    return split_by_mode(list(prof.events()), device), errors


def split_by_mode(events: list, device: str) -> dict[str, dict[str, KernelStat]]:
    """kernel_stats of the events after each mode's marker (CPU start time; the GPU
    timestamps are on the same clock) and before the next one."""
    marks = sorted((e.time_range.start, e.name[len(_MARK):]) for e in events if e.name.startswith(_MARK))
    if not marks:
        return {}
    windows: dict[str, list] = {name: [] for _, name in marks}
    for evt in events:
        start = evt.time_range.start
        mode = next((name for t, name in reversed(marks) if t <= start), None)
        if mode is not None:
            windows[mode].append(evt)
    return {name: kernel_stats(evts, device) for name, evts in windows.items()}


_NOISE = ("void ", "at::native::", "(anonymous namespace)::", "at::", "c10::", "std::", "cutlass::")


def short_name(name: str, width: int = 60) -> str:
    """A kernel's name without namespaces (torch's templated names carry the functor,
    the telling part, far to the right), cut to width."""
    for noise in _NOISE:
        name = name.replace(noise, "")
    name = " ".join(name.split())
    return name if len(name) <= width else name[:width - 3] + "..."


# First match wins. Triton kernels are named after their Python functions (ours start with _).
_GROUPS = (
    ("attention", lambda n: any(k in n for k in ("_decode_kernel", "_reduce_kernel", "_prefill_kernel"))),
    ("gemm", lambda n: any(k in n.lower() for k in ("gemm", "nvjet", "cutlass", "xmma", "splitk", "cublas"))),
    ("memcpy/set", lambda n: n.lower().startswith(("memcpy", "memset"))),
    ("triton other", lambda n: n.startswith(("_", "triton")) and "::" not in n),
)


def group_of(name: str) -> str:
    return next((group for group, match in _GROUPS if match(name)), "torch ops")


def format_profile(profiles: dict[str, StepProfile], unit: str, top: int = 15, width: int = 60) -> list[str]:
    """The top kernels of the last profile that has any (by time per step), with every
    profile's ms per step side by side, then totals, wall times and groups: a short table
    for a log tail."""
    modes = list(profiles)
    ref_mode = next((m for m in reversed(modes) if profiles[m].kernels), modes[-1])
    ref = profiles[ref_mode]
    names = sorted(ref.kernels, key=lambda n: -ref.ms(n))[:top]
    total = ref.total_ms() or 1.0
    head = f"{unit + ' (per step)':<{width}}" + "".join(f"{m + ' ms':>10}" for m in modes)
    lines = [head + f"{'calls':>7}{'% ' + ref_mode:>9}"]
    for n in names:
        lines.append(f"{short_name(n, width):<{width}}" + "".join(f"{profiles[m].ms(n):>10.3f}" for m in modes)
                     + f"{ref.calls(n):>7.0f}{100 * ref.ms(n) / total:>8.1f}%")
    lines.append(f"{'sum of all ' + unit + 's':<{width}}" + "".join(f"{profiles[m].total_ms():>10.3f}" for m in modes)
                 + f"{ref.total_calls():>7.0f}")
    lines.append(f"{'wall per step, unprofiled (mean)':<{width}}"
                 + "".join(f"{profiles[m].wall_s * 1e3:>10.3f}" for m in modes))
    for m in modes:
        p = profiles[m]
        if p.replay_s is not None:
            lines.append(f"{m}: graph replay alone {p.replay_s * 1e3:.3f} ms")
        if p.kernels:
            lines.append(f"{m} groups (ms/step): " + ", ".join(f"{g} {ms:.2f}" for g, ms in p.groups().items()))
        else:
            lines.append(f"{m}: no {unit} events recorded (the mode failed, or CUPTI is missing)")
    return lines


# ------------------------------------------------------------------ ucx


@dataclass(frozen=True)
class UcxSetting:
    label: str
    env: dict[str, str] = field(default_factory=dict)
    nixl_params: dict[str, str] = field(default_factory=dict)  # NIXL UCX backend init parameters
    diagnose: bool = False  # also print the lanes and protocols UCX chose


_ERR_NONE = {"ucx_error_handling_mode": "none"}

# Most telling first: the section stops starting runs when its time budget is spent.
UCX_SETTINGS: tuple[UcxSetting, ...] = (
    UcxSetting("default"),
    # Which transport carries a VRAM put (cuda_ipc zero-copy, or emulated over tcp/AM)?
    UcxSetting("default + PROTO_INFO", {"UCX_PROTO_INFO": "y", "UCX_LOG_LEVEL": "info"}, diagnose=True),
    # NIXL posts one UCX request per descriptor; SGL posts a write's list as one request.
    UcxSetting("NIXL_UCX_SGL_ENABLE=y", {"NIXL_UCX_SGL_ENABLE": "y"}),
    # cuda_ipc reaps at most MAX_POLL (16) copy completions per progress call; a write
    # of 256 MiB in 512 KiB blocks is hundreds of copies.
    UcxSetting("CUDA_IPC_MAX_POLL=1024", {"UCX_CUDA_IPC_MAX_POLL": "1024"}),
    # NIXL's endpoints default to peer error handling, and UCX then drops every lane that
    # cannot report a peer's failure (shared memory: posix, sysv, cma) from selection.
    UcxSetting("err mode none", nixl_params=_ERR_NONE),
    UcxSetting("err mode none, TLS sm,cuda_ipc,cuda_copy,self", {"UCX_TLS": "sm,cuda_ipc,cuda_copy,self"},
               nixl_params=_ERR_NONE),
    UcxSetting("TLS cuda_ipc,cuda_copy,tcp,self", {"UCX_TLS": "cuda_ipc,cuda_copy,tcp,self"}),
    # Likely to fail under peer error handling (no lane for active messages), quickly.
    UcxSetting("TLS cuda_ipc,cuda_copy,self", {"UCX_TLS": "cuda_ipc,cuda_copy,self"}),
    UcxSetting("TLS sm,cuda_ipc,cuda_copy,self", {"UCX_TLS": "sm,cuda_ipc,cuda_copy,self"}),
    UcxSetting("TLS rc,cuda_copy,cuda_ipc,self", {"UCX_TLS": "rc,cuda_copy,cuda_ipc,self"}),
    UcxSetting("PROTO_ENABLE=n (v1 protocols)", {"UCX_PROTO_ENABLE": "n"}),
    # Matters only where puts are emulated over active messages (rendezvous).
    UcxSetting("RNDV_SCHEME=put_zcopy, THRESH=8K", {"UCX_RNDV_SCHEME": "put_zcopy", "UCX_RNDV_THRESH": "8192"}),
    UcxSetting("SGL + MAX_POLL=1024 + err mode none",
               {"NIXL_UCX_SGL_ENABLE": "y", "UCX_CUDA_IPC_MAX_POLL": "1024"}, nixl_params=_ERR_NONE),
)

# "key=value,..." added to the init parameters of every NIXL UCX backend created in a
# process that has it (and in its children: benchmarks/kv/transfer.py's receiver is spawned).
NIXL_PARAMS_ENV = "GPU_CHECK_NIXL_UCX_PARAMS"


def transfer_command(device: str, sizes_mib: list[int], desc_kib: int, block_kib: int,
                     repeats: int = 3) -> list[str]:
    """benchmarks/kv/transfer.py for nixl alone, as the transfer section measures it, run
    through this module (see the end of it) so that NIXL_PARAMS_ENV takes effect."""
    return [sys.executable, str(Path(__file__).resolve()), "--transports", "nixl",
            "--sizes-mib", ",".join(map(str, sizes_mib)), "--desc-kib", str(desc_kib),
            "--block-kib", str(block_kib), "--device", device, "--repeats", str(repeats)]


def child_env(base: Mapping[str, str], setting: UcxSetting) -> dict[str, str]:
    """base without UCX_* and NIXL_UCX_* (so "default" is the libraries' default), plus
    the setting's variables."""
    env = {k: v for k, v in base.items()
           if not k.startswith(("UCX_", "NIXL_UCX_")) and k != NIXL_PARAMS_ENV}
    env.update(setting.env)
    if setting.nixl_params:
        env[NIXL_PARAMS_ENV] = ",".join(f"{k}={v}" for k, v in setting.nixl_params.items())
    env["PYTHONUNBUFFERED"] = "1"  # a killed run still shows how far it got
    return env


_RESULT = re.compile(r"nixl\s+(\d+) MiB in\s+(\d+) KiB descriptors:\s+([\d.]+) GiB/s")


def parse_gbs(output: str) -> dict[int, float]:
    """GB/s (1e9 bytes, as the transfer section prints) per transfer size in MiB."""
    return {int(m.group(1)): float(m.group(3)) * 2**30 / 1e9 for m in _RESULT.finditer(output)}


@dataclass
class RunResult:
    returncode: int | None  # None: killed at the timeout
    output: str  # stdout and stderr together
    seconds: float


def run_with_timeout(cmd: list[str], env: Mapping[str, str], timeout_s: float) -> RunResult:
    """Run cmd in its own process group; at the timeout kill the group (benchmarks/kv/transfer.py's
    receiver is a child of cmd and would otherwise hold the GPU)."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, env=dict(env), cwd=_REPO_ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, errors="replace", start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout_s)
        code: int | None = proc.returncode
    except subprocess.TimeoutExpired:
        code = None
        _kill_group(proc.pid)
        out, _ = proc.communicate()
    _kill_group(proc.pid)  # anything of ours still left in the group
    return RunResult(code, out, time.perf_counter() - start)


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


_UCX_PREFIX = re.compile(r"^\[[\d.]+\]\s+\[[^\]]*\]\s*")


def failure_line(output: str, width: int = 90) -> str:
    """The line that best says why a run failed: UCX's first error (it names the cause;
    NIXL's exception after it only says NIXL_ERR_BACKEND), else the last line naming an
    error, else the last line."""
    lines = [ln.strip() for ln in output.splitlines() if ln.strip()]
    ucx = [ln for ln in lines if re.search(r"UCX\s+ERROR", ln)]
    errors = [ln for ln in lines if re.search(r"error|exception|failed|refused", ln, re.IGNORECASE)]
    line = ucx[0] if ucx else (errors or lines or ["no output"])[-1]
    line = re.sub(r"^\S+:\d+\s+UCX\s+ERROR\s+", "UCX: ", _UCX_PREFIX.sub("", line))
    return " ".join(line.split())[:width]


def ucx_diagnosis(output: str, limit: int = 14, width: int = 150) -> list[str]:
    """From a UCX_PROTO_INFO=y UCX_LOG_LEVEL=info run: UCX's version, the lanes of each
    intra-node endpoint, each remote-write protocol table (one line each), and warnings."""
    tables: dict[str, list[str]] = {}  # a table's lines share one log prefix
    picked: list[str] = []
    for raw in output.splitlines():
        m = _UCX_PREFIX.match(raw)
        if not m:
            continue
        text = raw[m.end():].strip()
        if text.startswith("|"):
            cells = [c.strip() for c in text.strip("|").split("|")]
            tables.setdefault(m.group(0), []).append(" ".join(c for c in cells if c))
        elif "Version" in text:
            picked.append(re.sub(r"\s*\(loaded from.*", "", text.split("INFO", 1)[-1].strip()))
        elif "intra-node cfg#" in text or " WARN " in text or " ERROR " in text:
            picked.append(re.sub(r"^\S+\s+UCX\s+\w+\s+", "", text))
    for rows in tables.values():
        if len(rows) >= 2 and "intra-node" in rows[0] and "remote memory write" in rows[1]:
            body = [r for r in rows[2:] if not r.startswith("Range")]
            picked.append(f"{rows[0]}: {rows[1]}: " + "; ".join(body))
    seen: list[str] = []
    for line in picked:  # sender and receiver print the same lines
        if line not in seen:
            seen.append(line)
    return [line[:width] for line in seen[:limit]]


def add_nixl_ucx_params(spec: str) -> None:
    """Make every NIXL agent of this process create its UCX backend with these extra init
    parameters ("key=value,..."): nixl_agent_config has no field for them."""
    from nixl._api import nixl_agent

    params = dict(item.split("=", 1) for item in spec.split(",") if item)
    create = nixl_agent.create_backend

    def create_backend(self, backend: str, init_params: dict[str, str] | None = None):
        if backend == "UCX":
            init_params = {**(init_params or {}), **params}
        return create(self, backend, init_params or {})

    nixl_agent.create_backend = create_backend


# At import, not under __main__: the receiver that benchmarks/kv/transfer.py spawns imports this
# module again as its main module, and needs the parameters too.
if os.environ.get(NIXL_PARAMS_ENV):
    add_nixl_ucx_params(os.environ[NIXL_PARAMS_ENV])

if __name__ == "__main__":  # python benchmarks/gpu/profiling.py <benchmarks/kv/transfer.py arguments>
    sys.path.insert(0, str(_REPO_ROOT))  # run as a file: the repo root first
    from benchmarks.kv.transfer import main

    main()
