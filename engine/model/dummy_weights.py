"""Generated weights for load_format "dummy" (vLLM's `--load-format dummy`): a model
directory needs only its config.json, and each parameter is drawn on the target device.

The invariant: a tensor depends only on (seed, its checkpoint name, its full shape,
the device type), never on the process, the tensor-parallel rank or the order of
loading. So a prefill and a decode worker, their colocated twin, and every rank of any
tensor-parallel size hold the same model: this reads like a checkpoint (DummyCheckpoint
has safetensors' safe_open interface), and a rank slices the full tensor exactly as it
would slice one read from disk (engine/model/loader.py).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator

import torch

# Norm weights 1 (what a trained norm starts from), everything else N(0, STD^2):
# activations stay near unit scale through the layers, so a bf16 forward stays finite.
STD = 0.02


def checkpoint_shapes(params: dict[str, tuple[int, ...]], fused: dict[str, tuple[str, int]],
                      piece_rows: dict[str, list[int]]) -> dict[str, tuple[int, ...]]:
    """Checkpoint tensor name -> full shape, from the unsharded model's parameter shapes:
    a fused parameter (qkv_proj, gate_up_proj) splits back into the checkpoint's pieces
    (q/k/v_proj, gate/up_proj), whose row counts piece_rows gives."""
    out: dict[str, tuple[int, ...]] = {}
    for name, shape in params.items():
        pieces = [(ckpt, index) for ckpt, (ours, index) in fused.items() if f".{ours}." in name]
        if not pieces:
            out[name] = shape
            continue
        for ckpt, index in pieces:
            ours = fused[ckpt][0]
            out[name.replace(ours, ckpt)] = (piece_rows[name][index], *shape[1:])
    return out


def _seed(seed: int, name: str) -> int:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def generate(name: str, shape: tuple[int, ...], seed: int, dtype: torch.dtype, device: str) -> torch.Tensor:
    """Checkpoint tensor `name` in full: ones for a norm's weight, else seeded N(0, STD^2),
    drawn in float32 (so every dtype rounds the same values) on `device`."""
    if name.endswith("norm.weight"):
        return torch.ones(shape, dtype=dtype, device=device)
    generator = torch.Generator(device=device)
    generator.manual_seed(_seed(seed, name))
    values = torch.randn(shape, generator=generator, dtype=torch.float32, device=device)
    return values.mul_(STD).to(dtype)


class _Slice:
    """safetensors' get_slice(): the shape, and rows or columns of the full tensor."""

    def __init__(self, make: Callable[[], torch.Tensor], shape: tuple[int, ...]) -> None:
        self._make, self._shape = make, shape

    def get_shape(self) -> list[int]:
        return list(self._shape)

    def __getitem__(self, index) -> torch.Tensor:
        return self._make()[index]


class DummyCheckpoint:
    """A checkpoint of generated tensors with the interface the loader reads a
    safetensors file by: keys(), get_tensor(name), get_slice(name)."""

    def __init__(self, shapes: dict[str, tuple[int, ...]], seed: int, dtype: torch.dtype, device: str) -> None:
        self.shapes, self.seed, self.dtype, self.device = shapes, seed, dtype, device

    def keys(self) -> Iterator[str]:
        return iter(self.shapes)

    def get_tensor(self, name: str) -> torch.Tensor:
        return generate(name, self.shapes[name], self.seed, self.dtype, self.device)

    def get_slice(self, name: str) -> _Slice:
        return _Slice(lambda: self.get_tensor(name), self.shapes[name])
