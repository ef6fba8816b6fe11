"""The rank-pair plan between TP sizes (kv_transfer/rank_pairs.py): which source rank
supplies each head of each destination rank, the pieces, and their descriptors."""

from __future__ import annotations

import itertools

import pytest

from kv_transfer.rank_pairs import (
    Piece,
    check_head_ranges,
    check_wire,
    count_descriptors,
    even_head_ranges,
    heads_moved,
    plan,
    wire,
)
from kv_transfer.runs import coalesce

CASES = [(kv, p, d) for kv in (1, 2, 4, 8) for p in range(1, 5) for d in range(1, 5)
         if (kv % p == 0 or p % kv == 0) and (kv % d == 0 or d % kv == 0)]


def test_every_supported_pairing_is_covered() -> None:
    # One KV head pairs any TP sizes (replicated); 2, 4 and 8 heads pair TP 1, 2 and 4.
    assert len(CASES) == 16 + 3 * 9
    assert {(p, d) for kv, p, d in CASES if kv == 1} == set(itertools.product(range(1, 5), repeat=2))


@pytest.mark.parametrize("kv,p,d", CASES)
def test_each_destination_head_comes_once_from_a_rank_that_holds_it(kv: int, p: int, d: int) -> None:
    src, dst = even_head_ranges(kv, p), even_head_ranges(kv, d)
    check_head_ranges(kv, src)
    check_head_ranges(kv, dst)
    pieces = plan(src, dst)
    assert pieces == plan(src, dst)  # deterministic
    filled: dict[tuple[int, int], int] = {}  # (dst rank, global head) -> source rank
    for pc in pieces:
        assert pc.num_heads >= 1
        for i in range(pc.num_heads):
            g_src = src[pc.src_rank][0] + pc.src_head + i
            g_dst = dst[pc.dst_rank][0] + pc.dst_head + i
            assert g_src == g_dst, f"{pc} moves head {g_src} into head {g_dst}"
            assert src[pc.src_rank][0] <= g_src < src[pc.src_rank][1]
            assert (pc.dst_rank, g_dst) not in filled, f"head {g_dst} of rank {pc.dst_rank} written twice"
            filled[(pc.dst_rank, g_dst)] = pc.src_rank
    # every destination rank gets exactly its own heads, nothing else
    assert set(filled) == {(r, h) for r, (s, e) in enumerate(dst) for h in range(s, e)}
    # the same rank index supplies a head whenever it holds it
    for (r, h), source in filled.items():
        if r < p and src[r][0] <= h < src[r][1]:
            assert source == r
    # consecutive heads of one source rank into one destination rank are one piece
    for a, b in zip(pieces, pieces[1:]):
        assert not (a.dst_rank == b.dst_rank and a.src_rank == b.src_rank
                    and a.src_head + a.num_heads == b.src_head and a.dst_head + a.num_heads == b.dst_head)
    # whole: every head of the block on both sides
    for pc in pieces:
        assert pc.whole == (pc.num_heads == src[pc.src_rank][1] - src[pc.src_rank][0]
                            == dst[pc.dst_rank][1] - dst[pc.dst_rank][0])
    assert heads_moved(pieces) == sum(e - s for s, e in dst)


@pytest.mark.parametrize("kv,p,d", CASES)
def test_descriptors_one_per_run_when_whole_else_one_per_block(kv: int, p: int, d: int) -> None:
    pieces = plan(even_head_ranges(kv, p), even_head_ranges(kv, d))
    runs = coalesce([0, 1, 2, 3, 9, 20, 21], [5, 6, 7, 8, 30, 40, 41])  # 3 runs, 7 blocks
    assert len(runs) == 3
    assert count_descriptors(pieces, runs) == sum(3 if pc.whole else 7 for pc in pieces)
    if p == d:  # homogeneous: every rank pair whole, one descriptor per run per rank
        assert all(pc.whole and pc.src_rank == pc.dst_rank for pc in pieces)
        assert count_descriptors(pieces, runs) == 3 * p


@pytest.mark.parametrize("kv,p,d,expected", [
    # TP 1 -> 2 (4 heads): each destination rank reads its half of the one source rank
    (4, 1, 2, [Piece(0, 0, 0, 0, 2, False), Piece(0, 1, 2, 0, 2, False)]),
    # TP 2 -> 1: the destination rank gets half from each source rank
    (4, 2, 1, [Piece(0, 0, 0, 0, 2, False), Piece(1, 0, 0, 2, 2, False)]),
    # TP 4 -> 2 (8 heads): two source ranks per destination rank
    (8, 4, 2, [Piece(0, 0, 0, 0, 2, False), Piece(1, 0, 0, 2, 2, False), Piece(2, 1, 0, 0, 2, False),
               Piece(3, 1, 0, 2, 2, False)]),
    # TP 1 -> 4 (4 heads): one head each, from the one source rank
    (4, 1, 4, [Piece(0, r, r, 0, 1, False) for r in range(4)]),
    # one KV head replicated at TP 2 from TP 1: both ranks get it whole (a block is that head)
    (1, 1, 2, [Piece(0, 0, 0, 0, 1, True), Piece(0, 1, 0, 0, 1, True)]),
    # replicated at TP 2 -> TP 4: ranks 2 and 3 read from the source ranks in turn
    (1, 2, 4, [Piece(0, 0, 0, 0, 1, True), Piece(1, 1, 0, 0, 1, True), Piece(0, 2, 0, 0, 1, True),
               Piece(1, 3, 0, 0, 1, True)]),
    # 2 heads at TP 4 (each held twice) -> TP 2 (one each): rank 1's head 1 is on source
    # ranks 2 and 3; it is read from rank 3 (1 % 2 picks the second holder)
    (2, 4, 2, [Piece(0, 0, 0, 0, 1, True), Piece(3, 1, 0, 0, 1, True)]),
    # 2 heads at TP 2 -> TP 4: destination ranks 0, 1 hold head 0; 2, 3 head 1
    (2, 2, 4, [Piece(0, 0, 0, 0, 1, True), Piece(0, 1, 0, 0, 1, True), Piece(1, 2, 0, 0, 1, True),
               Piece(1, 3, 0, 0, 1, True)]),
])
def test_known_plans(kv: int, p: int, d: int, expected: list[Piece]) -> None:
    assert plan(even_head_ranges(kv, p), even_head_ranges(kv, d)) == expected


def test_even_head_ranges() -> None:
    assert even_head_ranges(8, 4) == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert even_head_ranges(2, 4) == [(0, 1), (0, 1), (1, 2), (1, 2)]
    assert even_head_ranges(1, 3) == [(0, 1)] * 3
    assert even_head_ranges(3, 1) == [(0, 3)]


def test_ranges_in_another_order_still_pair() -> None:
    src, dst = [(2, 4), (0, 2)], [(0, 4)]  # source rank 0 holds the upper half
    check_head_ranges(4, src)
    assert plan(src, dst) == [Piece(1, 0, 0, 0, 2, False), Piece(0, 0, 0, 2, 2, False)]


@pytest.mark.parametrize("kv,ranges,message", [
    (3, [(0, 2), (2, 3)], "3 KV heads do not divide over TP 2"),
    (4, [(0, 3)] * 3, "4 KV heads do not divide over TP 3"),
    (4, [(0, 2), (0, 2)], r"no rank holds KV heads \[2, 3\] of 4"),
    (4, [(0, 2), (2, 5)], r"rank 1 holds heads \[2, 5\), outside \[0, 4\)"),
    (4, [(0, 1), (1, 4)], "rank 0 holds 1 heads .* every rank holds 2"),
    (2, [(0, 1), (0, 1), (0, 1), (0, 1)], r"no rank holds KV heads \[1\]"),
    (2, [(0, 1), "x"], "rank 1's head range must be two ints"),
    (0, [(0, 1)], "num_kv_heads must be a positive int"),
    (2, [], "the TP size must be a positive int"),
])
def test_impossible_head_splits_are_refused_saying_why(kv: int, ranges: list, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        check_head_ranges(kv, ranges)
    if kv in (3, 4) and len(ranges) in (2, 3) and "divide" in message:
        with pytest.raises(ValueError, match=message):
            even_head_ranges(kv, len(ranges))


def test_the_receiver_checks_a_notifications_pieces() -> None:
    local = [2, 2]  # a TP 2 receiver with 2 heads per rank
    good = wire(plan(even_head_ranges(4, 1), even_head_ranges(4, 2)))
    assert good == [(0, 0, 2, 0), (1, 0, 2, 0)]
    assert check_wire(good, local) == ""
    assert check_wire([[0, 0, 2, 1], [1, 0, 1, 0], [1, 1, 1, 0]], local) == ""
    assert "no piece writes some heads of rank 1" in check_wire([[0, 0, 2, 0]], local)
    assert "writes a head twice" in check_wire([[0, 0, 2, 0], [0, 1, 1, 0], [1, 0, 2, 0]], local)
    assert "a piece for rank 2" in check_wire([[2, 0, 2, 0]], local)
    assert "does not fit" in check_wire([[0, 1, 2, 0]], local)
    assert "claims every head" in check_wire([[0, 0, 1, 1], [0, 1, 1, 0], [1, 0, 2, 0]], local)
    assert "must be [dst_rank" in check_wire([[0, 0, 2]], local)
