"""Which rank of the sending worker moves which KV heads into which rank of the receiving
worker, when the two run at different tensor-parallel (TP) sizes. Pure: no torch.

A worker at TP size t holds the model's num_kv_heads KV heads split over its ranks: rank
r holds the global heads [start, end), its head range. With at least as many heads as
ranks, each rank holds num_kv_heads / t of them; with fewer, each holds one, and
t / num_kv_heads ranks hold the same head (replication). Block ids are the same on every
rank, so a write's block list holds for every rank pair.

Multi-head latent attention (DeepSeek) caches one latent per token: one KV head every
rank holds (num_kv_heads 1, replicated at any TP size). So each destination rank gets
the whole latent block, every layer of it one region, from one source rank: the source
rank of its own index when there is one (equal TP sizes, or a larger sending worker),
else rank 0.

The plan (plan()): each destination rank gets each of its heads from exactly one source
rank that holds it, chosen in this order: the source rank with the same index; else the
one that supplied the destination rank's previous head (one piece rather than two); else
the holders taken in turn by destination rank, so that replicated heads are read from
several source ranks rather than all from one. A rank pair moves only heads the
destination rank owns. Consecutive heads from one source rank into one destination rank
are one Piece.

Descriptors (count_descriptors()): with the cache laid out [blocks, kv_heads, layers,
planes, block_size, head_dim], a head slice of one block is one contiguous region and a run of
consecutive blocks with all of a rank's heads is one too. So a piece that is every head
of the block on both sides (`whole`) is one descriptor per run of consecutive blocks; any
other piece is one descriptor per block.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

HeadRange = tuple[int, int]  # [start, end) of the model's KV heads


@dataclass(frozen=True)
class Piece:
    """Heads [src_head, src_head + num_heads) of the source rank's cache go to heads
    [dst_head, dst_head + num_heads) of the destination rank's, in every block written
    (offsets into each rank's own heads)."""

    src_rank: int
    dst_rank: int
    src_head: int
    dst_head: int
    num_heads: int
    whole: bool  # every head of the block on both sides: one region per run of blocks


def even_head_ranges(num_kv_heads: int, tp_size: int) -> list[HeadRange]:
    """The Megatron split: rank r holds heads [r * k, (r + 1) * k) with k = num_kv_heads /
    tp_size, or, with fewer heads than ranks, head r * num_kv_heads // tp_size."""
    _check_divides(num_kv_heads, tp_size)
    if num_kv_heads >= tp_size:
        k = num_kv_heads // tp_size
        return [(r * k, (r + 1) * k) for r in range(tp_size)]
    return [(h, h + 1) for h in (r * num_kv_heads // tp_size for r in range(tp_size))]


def _check_divides(num_kv_heads: int, tp_size: int) -> None:
    if type(num_kv_heads) is not int or num_kv_heads < 1:
        raise ValueError(f"num_kv_heads must be a positive int, got {num_kv_heads!r}")
    if type(tp_size) is not int or tp_size < 1:
        raise ValueError(f"the TP size must be a positive int, got {tp_size!r}")
    if num_kv_heads % tp_size and tp_size % num_kv_heads:
        raise ValueError(f"{num_kv_heads} KV heads do not divide over TP {tp_size} (nor TP {tp_size} over "
                         f"{num_kv_heads} heads): the ranks would hold different numbers of heads")


def check_head_ranges(num_kv_heads: int, ranges: Sequence[HeadRange]) -> None:
    """Raise ValueError, saying why, unless `ranges` (one per rank) split num_kv_heads the
    way a TP worker can hold them: every rank the same number of heads (num_kv_heads /
    TP, or one when replicated), each range inside [0, num_kv_heads), every head held."""
    _check_divides(num_kv_heads, len(ranges))
    per_rank = max(1, num_kv_heads // len(ranges))
    held: set[int] = set()
    for r, rng in enumerate(ranges):
        if not (isinstance(rng, (tuple, list)) and len(rng) == 2 and all(type(x) is int for x in rng)):
            raise ValueError(f"rank {r}'s head range must be two ints (start, end), got {rng!r}")
        start, end = rng
        if not 0 <= start < end <= num_kv_heads:
            raise ValueError(f"rank {r} holds heads [{start}, {end}), outside [0, {num_kv_heads})")
        if end - start != per_rank:
            raise ValueError(f"rank {r} holds {end - start} heads [{start}, {end}); with {num_kv_heads} KV heads "
                             f"at TP {len(ranges)} every rank holds {per_rank}")
        held.update(range(start, end))
    missing = sorted(set(range(num_kv_heads)) - held)
    if missing:
        raise ValueError(f"no rank holds KV heads {missing[:8]} of {num_kv_heads}")


def plan(src: Sequence[HeadRange], dst: Sequence[HeadRange]) -> list[Piece]:
    """The pieces that fill every destination rank's heads from the source ranks (both
    sides' ranges checked by check_head_ranges against one head count), ordered by
    destination rank, then head."""
    pieces: list[Piece] = []
    for d, (d_start, d_end) in enumerate(dst):
        prev: int | None = None
        for h in range(d_start, d_end):
            holders = [r for r, (s, e) in enumerate(src) if s <= h < e]
            if not holders:
                raise ValueError(f"no source rank holds KV head {h}")
            if d in holders:
                r = d
            elif prev in holders:
                r = prev
            else:
                r = holders[d % len(holders)]
            src_off, dst_off = h - src[r][0], h - d_start
            last = pieces[-1] if pieces and prev is not None else None
            if (last is not None and last.src_rank == r and last.src_head + last.num_heads == src_off):
                pieces[-1] = Piece(r, d, last.src_head, last.dst_head, last.num_heads + 1, False)
            else:
                pieces.append(Piece(r, d, src_off, dst_off, 1, False))
            prev = r
    return [Piece(p.src_rank, p.dst_rank, p.src_head, p.dst_head, p.num_heads,
                  p.num_heads == src[p.src_rank][1] - src[p.src_rank][0] == dst[p.dst_rank][1] - dst[p.dst_rank][0])
            for p in pieces]


def count_descriptors(pieces: Sequence[Piece], runs: Sequence[tuple[int, int, int]],
                      layers: tuple[int, int] | None = None) -> int:
    """Contiguous regions a write of `runs` (src_start, dst_start, count; runs.coalesce)
    moves: one per run for a whole piece, one per block for any other; with a layer
    range short of every layer, one per head of each block (the layers of one head of
    a block are contiguous, its heads are not), unless the data plane gathers each
    run's range into one buffer first (tcp, nccl: then pass layers None)."""
    num_blocks = sum(n for *_, n in runs)
    if layers is not None:
        return num_blocks * heads_moved(pieces)
    return sum(len(runs) if p.whole else num_blocks for p in pieces)


def heads_moved(pieces: Sequence[Piece]) -> int:
    """Heads each block of a write moves, over every rank pair (a replicated destination
    head is moved once per rank that holds it)."""
    return sum(p.num_heads for p in pieces)


def wire(pieces: Sequence[Piece]) -> list[tuple[int, int, int, int]]:
    """The pieces as the receiver needs them, in a write's notification (protocol
    kv_control.Written.pieces): (dst_rank, dst_head, num_heads, whole) each, in the
    order of the write's data (tcp's frames)."""
    return [(p.dst_rank, p.dst_head, p.num_heads, int(p.whole)) for p in pieces]


def check_wire(pieces: Sequence[Sequence[int]], local_heads: Sequence[int]) -> str:
    """Why a notification's pieces (wire()) cannot fill a receiver whose rank r holds
    local_heads[r] heads: "" if every head of every rank is written exactly once."""
    filled: list[list[bool]] = [[False] * n for n in local_heads]
    for piece in pieces:
        if len(piece) != 4:
            return f"a piece must be [dst_rank, dst_head, num_heads, whole], got {list(piece)}"
        rank, head, n, whole = piece
        if not 0 <= rank < len(local_heads):
            return f"a piece for rank {rank}; this worker has {len(local_heads)}"
        if n < 1 or head < 0 or head + n > local_heads[rank] or whole not in (0, 1):
            return f"piece {list(piece)} does not fit rank {rank}'s {local_heads[rank]} heads"
        if whole and n != local_heads[rank]:
            return f"piece {list(piece)} claims every head of rank {rank}, which holds {local_heads[rank]}"
        if any(filled[rank][head:head + n]):
            return f"piece {list(piece)} writes a head twice"
        filled[rank][head:head + n] = [True] * n
    empty = [r for r, heads in enumerate(filled) if not all(heads)]
    return f"no piece writes some heads of rank {empty[0]}" if empty else ""
