"""What two workers must agree on before one may write KV blocks into the other."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch

from kv_transfer.rank_pairs import HeadRange, check_head_ranges

# The engine's cache layout (engine/kv_cache/layout.py), one tensor per TP rank holding that rank's KV heads. Heads
# outside layers, block-major: a head slice of one block is one contiguous region (a
# transfer between TP sizes moves one per block), and a run of blocks with all of a
# rank's heads is one too (a transfer between equal TP sizes moves one per run).
LAYOUT = "block_major:[blocks,kv_heads,layers,2,block_size,head_dim]"
# Multi-head latent attention (DeepSeek): one plane, one latent "head" every rank holds
# whole, so a destination rank always receives whole blocks from one source rank.
LATENT_LAYOUT = "block_major:[blocks,1,layers,1,block_size,kv_lora_rank+qk_rope_head_dim]"

# Must be equal on both sides; the TP size and head ranges may differ (rank_pairs.py).
# An fp8 cache's bytes mean something only under their scales (engine/attention/kv_quant.py):
# a peer with another dtype or other scales is refused, not converted, since a
# conversion would cost a pass over every block on the critical path of each request,
# and two pools of one deployment that disagree are a configuration mistake to fix.
MUST_MATCH = ("model", "dtype", "layout", "block_size", "num_layers", "num_kv_heads", "head_dim", "kv_scales")
_HINTS = {"dtype": " (the KV cache's element type: give both pools the same dtype and kv_cache_dtype)",
          "kv_scales": " (an fp8 cache's per-layer (k_scale, v_scale): both pools must load the same checkpoint)"}


class IncompatiblePeerError(ValueError):
    """A handshake whose compatibility record differs from ours; names the field."""


@dataclass(frozen=True)
class KVCompat:
    model: str
    dtype: str
    layout: str
    block_size: int
    num_layers: int
    num_kv_heads: int  # the model's, over every rank
    head_dim: int
    tp_size: int = 1
    head_ranges: tuple[HeadRange, ...] = ()  # per rank: the model's heads [start, end) it holds
    # An fp8 cache's per-layer (k_scale, v_scale), the same on every rank; () otherwise.
    kv_scales: tuple[tuple[float, float], ...] = ()

    @classmethod
    def from_caches(cls, caches: Sequence[torch.Tensor], model: str, num_kv_heads: int,
                    head_ranges: Sequence[HeadRange],
                    kv_scales: Sequence[tuple[float, float]] = ()) -> KVCompat:
        """The record of a worker whose rank r holds caches[r], the heads head_ranges[r];
        ValueError, saying what is wrong, unless they form one TP worker's cache."""
        if not caches:
            raise ValueError("no KV cache to register")
        if len(head_ranges) != len(caches):
            raise ValueError(f"{len(caches)} rank caches but {len(head_ranges)} head ranges")
        first = caches[0]
        for r, cache in enumerate(caches):
            if not isinstance(cache, torch.Tensor) or cache.dim() != 6 or cache.shape[3] not in (1, 2):
                shape = tuple(cache.shape) if isinstance(cache, torch.Tensor) else type(cache).__name__
                raise ValueError(f"rank {r}: expected a {LAYOUT} or {LATENT_LAYOUT} cache, got shape {shape}")
            if not cache.is_contiguous():
                raise ValueError(f"rank {r}: the KV cache must be contiguous to be registered for transfer")
            if cache.dtype != first.dtype or cache.device != first.device:
                raise ValueError(f"rank {r}'s cache is {cache.dtype} on {cache.device}, rank 0's "
                                 f"{first.dtype} on {first.device}")
            for dim, name in ((0, "num_blocks"), (2, "layers"), (3, "planes"), (4, "block_size"), (5, "head_dim")):
                if cache.shape[dim] != first.shape[dim]:
                    raise ValueError(f"rank {r}'s cache has {name} {cache.shape[dim]}, rank 0's "
                                     f"{first.shape[dim]}: every rank must hold the same blocks")
        # cast: check_head_ranges refuses, naming it, any range that is not a (start, end) pair.
        ranges = cast(tuple[HeadRange, ...],
                      tuple(tuple(rng) if isinstance(rng, (tuple, list)) else rng for rng in head_ranges))
        check_head_ranges(num_kv_heads, ranges)
        for r, ((start, end), cache) in enumerate(zip(ranges, caches)):
            if cache.shape[1] != end - start:
                raise ValueError(f"rank {r} holds heads [{start}, {end}) but its cache has {cache.shape[1]} "
                                 "KV heads")
        _, _, layers, planes, block_size, head_dim = first.shape
        if planes == 1 and num_kv_heads != 1:
            raise ValueError(f"a latent (one-plane) cache holds one KV head, not {num_kv_heads}")
        layout = LATENT_LAYOUT if planes == 1 else LAYOUT
        scales = tuple((float(k), float(v)) for k, v in kv_scales)
        if scales and len(scales) != layers:
            raise ValueError(f"{len(scales)} layers of KV scales for a cache of {layers} layers")
        return cls(model, str(first.dtype).removeprefix("torch."), layout, block_size, layers,
                   num_kv_heads, head_dim, len(caches), ranges, scales)

    @property
    def head_bytes(self) -> int:
        """One KV head of one block, every layer: a contiguous region of a rank's cache."""
        itemsize = torch.empty(0, dtype=getattr(torch, self.dtype)).element_size()
        return self.num_layers * self.planes * self.block_size * self.head_dim * itemsize

    @property
    def planes(self) -> int:
        """Vectors per token, layer and head: K and V, or MLA's one latent."""
        return 1 if self.layout == LATENT_LAYOUT else 2

    @property
    def block_bytes(self) -> int:
        """One block of every head of the model (at TP 1: one block of the cache)."""
        return self.num_kv_heads * self.head_bytes

    @property
    def local_heads(self) -> list[int]:
        """How many heads each rank's cache holds."""
        return [end - start for start, end in self.head_ranges]

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> KVCompat:
        names = {f.name for f in dataclasses.fields(cls)}
        if not isinstance(d, dict) or set(d) != names:
            raise IncompatiblePeerError(f"malformed compatibility record: {d!r}")
        ranges, scales = d["head_ranges"], d["kv_scales"]
        if not isinstance(ranges, (list, tuple)):
            raise IncompatiblePeerError(f"malformed compatibility record: head_ranges {ranges!r}")
        if not isinstance(scales, (list, tuple)) or not all(isinstance(s, (list, tuple)) for s in scales):
            raise IncompatiblePeerError(f"malformed compatibility record: kv_scales {scales!r}")
        # msgpack hands tuples back as lists
        return cls(**dict(d, head_ranges=tuple(tuple(r) if isinstance(r, (list, tuple)) else r for r in ranges),
                          kv_scales=tuple(tuple(s) for s in scales)))

    def check_peer(self, peer: KVCompat, peer_name: str) -> None:
        """Raise IncompatiblePeerError naming the first field that differs, or why the
        peer's split of the heads over its ranks cannot be paired with ours."""
        if (self.layout == LATENT_LAYOUT) != (peer.layout == LATENT_LAYOUT):
            kinds = ("per-head K/V", "MLA latent")
            raise IncompatiblePeerError(
                f"peer {peer_name!r} is incompatible: its KV cache is {kinds[peer.layout == LATENT_LAYOUT]}, "
                f"this worker's {kinds[self.layout == LATENT_LAYOUT]} (layout {peer.layout!r} there, "
                f"{self.layout!r} here): an MLA model pairs only with MLA workers")
        for name in MUST_MATCH:
            ours, theirs = getattr(self, name), getattr(peer, name)
            if ours != theirs:
                raise IncompatiblePeerError(
                    f"peer {peer_name!r} is incompatible: {name} is {theirs!r} there, "
                    f"{ours!r} here{_HINTS.get(name, '')}")
        if peer.tp_size != len(peer.head_ranges):
            raise IncompatiblePeerError(f"peer {peer_name!r} is incompatible: tp_size {peer.tp_size!r} but "
                                        f"{len(peer.head_ranges)} head ranges")
        try:
            check_head_ranges(peer.num_kv_heads, peer.head_ranges)
        except ValueError as exc:
            raise IncompatiblePeerError(f"peer {peer_name!r} at TP {peer.tp_size} cannot be paired with this "
                                        f"worker at TP {self.tp_size}: {exc}") from None
