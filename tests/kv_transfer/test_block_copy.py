"""cuda_ipc's one-launch block copy, under the Triton interpreter on CPU."""

from __future__ import annotations

import pytest
import torch

from kv_transfer.block_copy import as_words, copy_blocks


@pytest.mark.parametrize("block_bytes,dtype", [(40, torch.int64), (12, torch.int32), (6, torch.int16),
                                               (3, torch.uint8)])
def test_copies_scattered_blocks_and_nothing_else(block_bytes: int, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    src = torch.randint(0, 256, (7, block_bytes), dtype=torch.uint8, generator=g)
    dst = torch.randint(0, 256, (9, block_bytes), dtype=torch.uint8, generator=g)
    expected = dst.clone()
    src_ids, dst_ids = [6, 0, 3, 4], [2, 8, 0, 5]  # out of order, both ends of both caches
    for s, d in zip(src_ids, dst_ids):
        expected[d] = src[s]
    words = as_words(src), as_words(dst)
    assert words[0].dtype == dtype
    copy_blocks(*words, torch.tensor(src_ids, dtype=torch.int32), torch.tensor(dst_ids, dtype=torch.int32))
    assert torch.equal(dst, expected)


def test_blocks_larger_than_one_program() -> None:
    src = torch.arange(2 * 5000, dtype=torch.int64).view(2, -1)  # 5000 words: two chunks per block
    dst = torch.zeros_like(src)
    copy_blocks(src, dst, torch.tensor([1, 0]), torch.tensor([0, 1]))
    assert torch.equal(dst, src.flip(0))


def test_bad_inputs_are_named() -> None:
    a = torch.zeros(4, 16, dtype=torch.uint8)
    with pytest.raises(ValueError, match="caches differ"):
        copy_blocks(as_words(a), torch.zeros(4, 2, dtype=torch.int32), torch.zeros(1), torch.zeros(1))
    with pytest.raises(ValueError, match="two 1-D id arrays of one length"):
        copy_blocks(as_words(a), as_words(a.clone()), torch.zeros(2, dtype=torch.int32),
                    torch.zeros(3, dtype=torch.int32))
    with pytest.raises(ValueError, match="contiguous \\[blocks, bytes\\] uint8"):
        as_words(torch.zeros(4, 4))


def test_block_pairs_undo_coalescing() -> None:
    from kv_transfer.runs import block_pairs, coalesce

    src, dst = [4, 5, 6, 0, 9, 10], [20, 21, 22, 3, 7, 8]
    pairs = block_pairs(coalesce(src, dst))
    assert [p.tolist() for p in pairs] == [src, dst] and pairs[0].dtype.name == "int32"
