"""Host-to-device upload of a step's small index arrays: one copy, no sync."""

from __future__ import annotations

import numpy as np
import torch

_ALIGN = 16  # bytes: every array's device view starts aligned for any dtype


class Uploader:
    """Packs numpy arrays into one pinned host buffer and copies it to the device with
    a single non-blocking copy, returning typed views of the device copy.

    The pinned buffer is reused by the next upload. That is safe because each engine
    step ends by reading its sampled tokens back to the host, which waits for every
    copy queued on the stream before it. On CPU the arrays are wrapped, not copied.
    """

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self._host: torch.Tensor | None = None

    def upload(self, *arrays: np.ndarray) -> list[torch.Tensor]:
        if self.device.type != "cuda":
            return [torch.from_numpy(np.ascontiguousarray(a)) for a in arrays]
        offsets, total = [], 0
        for a in arrays:
            offsets.append(total)
            total += -(-a.nbytes // _ALIGN) * _ALIGN
        if self._host is None or self._host.numel() < total:
            self._host = torch.empty(max(total, 4096) * 2, dtype=torch.uint8, pin_memory=True)
        host = self._host.numpy()
        for a, off in zip(arrays, offsets):
            host[off:off + a.nbytes] = np.ascontiguousarray(a).view(np.uint8).reshape(-1)
        packed = self._host[:max(total, 1)].to(self.device, non_blocking=True)
        return [packed[off:off + a.nbytes].view(torch.from_numpy(a[:0]).dtype).view(a.shape)
                for a, off in zip(arrays, offsets)]
