"""Rank 0's side of a tensor-parallel group: start one follower process per other rank,
wake them for each step and broadcast its inputs, and notice when one is gone.

A follower reads its orders as JSON lines on its stdin: first its start record, then
where its KV cache is, then one "step" line per step (the broadcast follows) or
"stop". Its stdin closing means the driver is gone: it exits. So a follower never
outlives its driver, and it never waits on a collective while the driver is idle
(a collective's timeout would end an idle group).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import os
import subprocess
import sys
import time
from typing import IO, Any

import torch
import torch.distributed as dist

from engine.config import EngineConfig
from engine.distributed import lora_sync
from engine.distributed.group import TorchGroup
from engine.distributed.step_codec import StepCodec
from engine.errors import RankFailure
from engine.runner import StepInputs

logger = logging.getLogger(__name__)

# Starting a follower (Python, torch, its shard of the weights) may take long on a busy
# host; a follower that dies meanwhile is noticed at once.
START_TIMEOUT_S = 600.0
HEARTBEAT_S = 5.0  # an idle group's ranks answer a tiny collective this often (heartbeat())
DRIVER_PID_ENV = "PDSERVE_TP_DRIVER_PID"  # a follower exits once this process is not its parent
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def rank_device(device: str, rank: int) -> str:
    """Rank r's device: the CPU, or the r-th GPU from the driver's."""
    if device == "cpu":
        return device
    base = int(device.partition(":")[2] or 0)
    return f"cuda:{base + rank}"


class TPDriver:
    def __init__(self, config: EngineConfig, codec: StepCodec) -> None:
        """Start the followers and join the group with them (waits, up to the start timeout)."""
        self.size = config.tensor_parallel_size
        self.codec = codec
        self._buffer = codec.buffer()
        self._procs: list[subprocess.Popen[bytes]] = []
        self._last = time.monotonic()  # when the group last ran a collective
        timeout = config.distributed_timeout_s
        self._store = store = dist.TCPStore("127.0.0.1", 0, self.size, True, wait_for_workers=False,
                                            timeout=datetime.timedelta(seconds=timeout))
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO_ROOT, env.get("PYTHONPATH")) if p)
        env[DRIVER_PID_ENV] = str(os.getpid())
        try:
            for rank in range(1, self.size):
                proc = subprocess.Popen([sys.executable, "-m", "engine.distributed.follower"],
                                        stdin=subprocess.PIPE, env=env)
                self._procs.append(proc)
                # The follower may resolve paths elsewhere (a Ray worker's directory).
                rank_config = dataclasses.replace(config, model=os.path.abspath(config.model),
                                                  device=rank_device(config.device, rank))
                self._send(rank, {"config": dataclasses.asdict(rank_config), "rank": rank,
                                  "port": store.port})
            # Joining the group waits at most the collective timeout: first let every
            # follower get that far (starting Python and torch takes a while).
            self._wait_for("started", store, START_TIMEOUT_S)
            self.group = TorchGroup(0, self.size, store.port, timeout, torch.device(config.device), store)
        except BaseException:
            self.close()
            raise

    def _send(self, rank: int, record: dict[str, Any] | str) -> None:
        proc = self._procs[rank - 1]
        line = (record if isinstance(record, str) else json.dumps(record)) + "\n"
        try:
            _stdin(proc).write(line.encode())
            _stdin(proc).flush()
        except (BrokenPipeError, OSError, ValueError) as exc:
            raise RankFailure(f"tensor-parallel rank {rank} is gone "
                              f"(exit code {proc.poll()}): {type(exc).__name__}") from exc

    @property
    def pids(self) -> list[int]:
        """The followers' process ids, rank 1 first."""
        return [proc.pid for proc in self._procs]

    def check_alive(self) -> None:
        for rank, proc in enumerate(self._procs, start=1):
            code = proc.poll()
            if code is not None:
                raise RankFailure(f"tensor-parallel rank {rank} of {self.size} exited with code {code}"
                                  f"{self._cause(rank)}")

    def _cause(self, rank: int) -> str:
        """What a follower that failed said before it exited, if it could."""
        try:
            if self._store.check([f"failed{rank}"]):
                return f": {self._store.get(f'failed{rank}').decode(errors='replace')}"
        except Exception:  # the store itself is unusable: the exit code is all there is
            pass
        return ""

    def attach_caches(self, paths: list[str] | None, num_blocks: int) -> None:
        """Tell each follower its KV cache: the file the driver made (CPU), or its own
        of num_blocks blocks to allocate (CUDA)."""
        for rank in range(1, self.size):
            self._send(rank, {"cache": paths[rank] if paths else None, "num_blocks": num_blocks})

    def wait_ready(self) -> None:
        """Until every follower has loaded its shard and attached its cache."""
        self._wait_for("ready", self.group.store, START_TIMEOUT_S)

    def _wait_for(self, stage: str, store: dist.TCPStore, timeout_s: float) -> None:
        """Until every follower has set its key for `stage`, failing at once if one exits."""
        keys = [f"{stage}{rank}" for rank in range(1, self.size)]
        deadline = time.monotonic() + timeout_s
        while not store.check(keys):  # a look, not a wait: the store logs every timed-out wait
            self.check_alive()
            if time.monotonic() > deadline:
                raise RankFailure(f"tensor-parallel followers not {stage} after {timeout_s:g} s")
            time.sleep(0.05)

    def broadcast_step(self, inputs: StepInputs) -> None:
        """Wake every follower for a step and broadcast its inputs."""
        self._order("step")
        self.group.broadcast_(self.codec.encode(inputs, self._buffer))

    def load_lora(self, slot: int, weights: lora_sync.Weights) -> None:
        """Every follower puts these adapter weights (whole: each slices its own) in
        LoRA slot `slot`, before the next step (lora_sync.py)."""
        keys, flat = lora_sync.pack(weights)
        self._order(json.dumps({"lora": slot, "keys": keys}))
        self.group.broadcast_(flat.to(self.group.device))

    def heartbeat(self) -> None:
        """Every follower answers one tiny collective, if none ran for HEARTBEAT_S: an
        idle group's stopped or hung rank is found within the collective timeout, not
        by the next request. A rank that exited is found at once (check_alive)."""
        if self.group.failure is None and time.monotonic() - self._last < HEARTBEAT_S:
            self.check_alive()
            return
        self._order("ping")
        self.group.all_reduce_(torch.zeros(1))

    def _order(self, order: str) -> None:
        if self.group.failure is not None:  # out of step for good: no waiting on a timeout again
            raise RankFailure(f"the tensor-parallel group failed earlier: {self.group.failure}")
        self.check_alive()
        for rank in range(1, self.size):
            self._send(rank, order)
        self._last = time.monotonic()

    def out_of_step(self, reason: str) -> RankFailure:
        """Rank 0 failed inside a broadcast step: the followers wait in collectives it
        will not join. Every later step fails at once."""
        self.group.failure = reason
        return RankFailure(f"rank 0's forward failed after the step was broadcast ({reason}): "
                           "the tensor-parallel group is out of step")

    def close(self) -> None:
        """Stop the followers (killed if they do not exit at once) and leave the group."""
        for rank, proc in enumerate(self._procs, start=1):
            try:
                self._send(rank, "stop")
                _stdin(proc).close()
            except (RankFailure, OSError):
                pass
        for proc in self._procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._procs = []
        group = getattr(self, "group", None)
        if group is not None:
            group.close()


def _stdin(proc: subprocess.Popen[bytes]) -> IO[bytes]:
    assert proc.stdin is not None  # every follower is started with stdin=PIPE
    return proc.stdin
