"""The collectives of one tensor-parallel group, each bounded by a timeout.

A process group is made directly (not torch.distributed's global default group), so
one process may hold several engines, each with its own group. On CPU the group is
gloo, on CUDA NCCL. A collective that fails or times out means a rank died or stalled:
the group is broken and so is every rank's state, so it raises RankFailure, an
EngineStateError (the worker ends, its supervisor restarts the whole group).
"""

from __future__ import annotations

import datetime
from typing import Any

import torch
import torch.distributed as dist

from engine.errors import RankFailure


class Group:
    """A group of one: every collective is the identity (TP 1 runs exactly as before)."""

    rank = 0
    size = 1

    def all_reduce_(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def gather_last_dim(self, x: torch.Tensor) -> torch.Tensor | None:
        """Concatenate every rank's x along the last dim on rank 0; None on the others."""
        return x

    def broadcast_(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def close(self) -> None:
        pass


SINGLE = Group()


class TorchGroup(Group):
    """`size` processes joined through a TCPStore at 127.0.0.1:`port` (rank 0 hosts it)."""

    def __init__(self, rank: int, size: int, port: int, timeout_s: float, device: torch.device,
                 store: dist.TCPStore | None = None) -> None:
        self.rank, self.size, self.device = rank, size, device
        self.failure: str | None = None  # once a collective failed, every later one fails at once
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.store = store or dist.TCPStore("127.0.0.1", port, size, rank == 0, timeout=self.timeout)
        # Any: torch's stubs declare the collectives (allreduce, gather, broadcast) on
        # ProcessGroup only, not on these backends, which have them at runtime.
        self.pg: Any
        if device.type == "cuda":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = self.timeout
            self.pg = dist.ProcessGroupNCCL(self.store, rank, size, options)
        else:
            self.pg = dist.ProcessGroupGloo(self.store, rank, size, self.timeout)

    @staticmethod
    def client_store(port: int, size: int) -> dist.TCPStore:
        """A follower's connection to the driver's store (its own waits are long: the
        driver may be loading its weights)."""
        return dist.TCPStore("127.0.0.1", port, size, False, timeout=datetime.timedelta(seconds=600))

    def _wait(self, what: str, work) -> None:
        if self.failure is not None:
            raise RankFailure(f"the tensor-parallel group failed earlier: {self.failure}")
        try:
            work.wait()
        except Exception as exc:
            self.failure = f"{what} failed: {type(exc).__name__}"
            raise RankFailure(f"tensor-parallel {what} failed on rank {self.rank} of {self.size} "
                              f"(a rank died, or stalled past {self.timeout.total_seconds():g} s): "
                              f"{type(exc).__name__}: {exc}") from exc

    def all_reduce_(self, x: torch.Tensor) -> torch.Tensor:
        self._wait("all-reduce", self.pg.allreduce([x]))
        return x

    def gather_last_dim(self, x: torch.Tensor) -> torch.Tensor | None:
        x = x.contiguous()
        options = dist.GatherOptions()
        options.rootRank = 0
        parts = [[torch.empty_like(x) for _ in range(self.size)]] if self.rank == 0 else []
        self._wait("gather", self.pg.gather(parts, [x], options))
        return torch.cat(parts[0], dim=-1) if self.rank == 0 else None

    def broadcast_(self, x: torch.Tensor) -> torch.Tensor:
        options = dist.BroadcastOptions()
        options.rootRank = 0
        self._wait("broadcast", self.pg.broadcast([x], options))
        return x

    def close(self) -> None:
        try:
            self.pg.abort()
        except Exception:  # already broken: nothing left to release cleanly
            pass
