"""A receiver's reservation (kv_transfer/receiver.py): its blocks, epoch and deadline,
which layers of each block have yet to come, and, once dead, what lifts its fence; and
the checks of a notification's runs and layer range against it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kv_transfer.liveness import ProcessId


@dataclass
class Reservation:
    epoch: int
    blocks: set[int]
    deadline: float  # time.time()
    sender: str | None  # agent name of the writer: named at expect(), else its first write
    # Reserved blocks not wholly written yet -> a bit per layer still missing (a
    # layer-wise stream writes each block layer group by layer group).
    missing: dict[int, int] = field(default_factory=dict)
    # Quarantined (one-sided): the senders whose word (cancel_ack) or exit lifts the
    # fence, each with its hello's (session, process) when it died (None: no hello
    # yet), which of them were declared gone, and when the cancels go out again.
    # Unnamed (no sender known): every sender known, and any that says hello before
    # the fence lifts.
    # Keyed (agent name, session): each process of that name that might write it (a
    # sender that says hello again under its name, restarted, is added: it may have
    # been sent the request); session None: no hello had come when it died.
    waiting_on: dict[tuple[str, str | None], ProcessId | None] = field(default_factory=dict)
    declared_gone: set[str] = field(default_factory=set)
    # A sender let go on its supervisor's word alone (not confirmed, not seen gone
    # here): a notification after the release may then mean bytes landed late.
    unproven: bool = False
    landing_seen: bool = False  # a write for it landed after it died (counted once)
    unnamed: bool = False
    killed_at: float = 0.0  # time.monotonic()
    cancel_at: float = 0.0  # time.monotonic()

    @classmethod
    def of(cls, epoch: int, blocks: Sequence[int], deadline: float, sender: str | None,
           num_layers: int, layer_masks: Sequence[int] | None = None) -> Reservation:
        """A live reservation of `blocks`, every layer of each still to come (or, per
        block, the layers its `layer_masks` bit names)."""
        masks = [(1 << num_layers) - 1] * len(blocks) if layer_masks is None else layer_masks
        return cls(epoch, set(blocks), deadline, sender, dict(zip(blocks, masks)))

    def take(self, blocks: Sequence[int], layers: tuple[int, int] | None, num_layers: int) -> list[int]:
        """Count `layers` (None: every one) of `blocks` in; returns the blocks that are
        whole now (a block already whole is not returned again)."""
        start, end = layers or (0, num_layers)
        arrived = ((1 << end) - 1) ^ ((1 << start) - 1)
        whole = []
        for b in blocks:
            left = self.missing.get(b)
            if left is None:
                continue
            left &= ~arrived
            if left:
                self.missing[b] = left
            else:
                del self.missing[b]
                whole.append(b)
        return whole


def check_layers(layers: Any, num_layers: int) -> str:
    """Why a layer range (a write's, or a notification's) cannot be of a cache of
    num_layers: "" if fine (None: every layer)."""
    if layers is None:
        return ""
    if len(layers) != 2:
        return f"layers {list(layers)} must be a [start, end) pair"
    start, end = layers
    if not 0 <= start < end <= num_layers:
        return f"layers [{start}, {end}) are not a range of the cache's {num_layers} layers"
    return ""


def check_masks(masks: Sequence[int] | None, num_blocks: int, num_layers: int) -> str:
    """Why per-block layer masks (a bit per layer to come) cannot be a reservation's of
    `num_blocks` blocks of a num_layers cache: "" if fine (None: every layer)."""
    if masks is None:
        return ""
    if len(masks) != num_blocks:
        return f"{len(masks)} layer masks for {num_blocks} reserved blocks"
    if any(not isinstance(m, int) or not 0 < m < 1 << num_layers for m in masks):
        return f"each block's layer mask must name some of the cache's {num_layers} layers, got {list(masks)[:5]}"
    return ""


def covered(runs: Any) -> set[int] | None:
    """Blocks covered by [[dst_start, count], ...], or None if malformed."""
    try:
        return {d + i for d, n in runs for i in range(n)
                if isinstance(d, int) and isinstance(n, int) and 0 < n}
    except (TypeError, ValueError):
        return None
