"""A LoRA adapter's weights from the driver to the other ranks of a tensor-parallel
group, when the driver's scheduler puts the adapter in a slot (engine/lora/slots.py).

The driver read the adapter once; the followers never read its files (which may have
changed since, or not be there): they get the driver's tensors, whole, as one float32
broadcast after an order naming the slot and each tensor's shape, and each keeps its
own slice (LoRALinear.set_slot). The order and the broadcast go before the step that
first runs the adapter, so every rank computes that step with the same weights.
"""

from __future__ import annotations

from typing import Any

import torch

Weights = dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]  # (layer, module) -> (A [r, in], B [out, r])


def pack(weights: Weights) -> tuple[list[list[Any]], torch.Tensor]:
    """(each tensor pair's [layer, module, r, in, out], every A and B flattened in that order)."""
    keys = [[layer, module, a.shape[0], a.shape[1], b.shape[0]] for (layer, module), (a, b) in weights.items()]
    flat = torch.cat([t.reshape(-1).float() for a, b in weights.values() for t in (a, b)]) if weights \
        else torch.zeros(0)
    return keys, flat


def buffer(keys: list[list[Any]], device: torch.device) -> torch.Tensor:
    """A receiver's buffer for pack()'s flat tensor."""
    return torch.zeros(sum(r * i + o * r for _, _, r, i, o in keys), dtype=torch.float32, device=device)


def unpack(keys: list[list[Any]], flat: torch.Tensor) -> Weights:
    out: Weights = {}
    at = 0
    for layer, module, r, i, o in keys:
        a = flat[at:at + r * i].view(r, i)
        b = flat[at + r * i:at + r * i + o * r].view(o, r)
        at += r * i + o * r
        out[(int(layer), str(module))] = (a, b)
    return out
