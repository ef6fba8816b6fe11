"""Host-to-device upload of a step's small index arrays: one copy, no sync."""

from __future__ import annotations

import numpy as np
import torch

_ALIGN = 16  # bytes: every array's device view starts aligned for any dtype


class Uploader:
    """Packs numpy arrays into one pinned host buffer and copies it to the device with
    a single non-blocking copy, returning typed views of the device copy.

    Pinned buffers are used in rotation, each with an event recorded after its copy: a
    buffer is refilled only once its last copy has run. With async scheduling the next
    step's inputs are packed while this step's copy may still be queued behind the
    step before. On CPU the arrays are wrapped, not copied.
    """

    _NUM_BUFFERS = 2  # at most one step is queued behind the one running

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self._hosts: list[torch.Tensor | None] = [None] * self._NUM_BUFFERS
        self._copied: list[torch.cuda.Event | None] = [None] * self._NUM_BUFFERS
        self._next = 0

    def upload(self, *arrays: np.ndarray) -> list[torch.Tensor]:
        if self.device.type != "cuda":
            return [torch.from_numpy(np.ascontiguousarray(a)) for a in arrays]
        offsets, total = [], 0
        for a in arrays:
            offsets.append(total)
            total += -(-a.nbytes // _ALIGN) * _ALIGN
        i, self._next = self._next, (self._next + 1) % self._NUM_BUFFERS
        copied = self._copied[i]
        if copied is not None:
            copied.synchronize()
        buffer = self._hosts[i]
        if buffer is None or buffer.numel() < total:
            buffer = self._hosts[i] = torch.empty(max(total, 4096) * 2, dtype=torch.uint8, pin_memory=True)
        host = buffer.numpy()
        for a, off in zip(arrays, offsets):
            host[off:off + a.nbytes] = np.ascontiguousarray(a).view(np.uint8).reshape(-1)
        packed = buffer[:max(total, 1)].to(self.device, non_blocking=True)
        copied = self._copied[i] = torch.cuda.Event()
        copied.record(torch.cuda.current_stream(self.device))  # the engine's device, not the current one
        return [packed[off:off + a.nbytes].view(torch.from_numpy(a[:0]).dtype).view(a.shape)
                for a, off in zip(arrays, offsets)]
