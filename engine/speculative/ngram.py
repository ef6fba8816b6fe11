"""N-gram drafts (prompt lookup): continue the sequence as it went on after the last
earlier place where its final n tokens occurred."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


def propose_ngram(tokens: Sequence[int], max_drafts: int, min_n: int, max_n: int) -> list[int]:
    """Up to max_drafts tokens that followed the latest earlier occurrence of the
    sequence's last n tokens, for the longest n in [min_n, max_n] that occurs; [] if
    none does. The latest occurrence is the likeliest to go on alike (a text being
    copied, a list being repeated)."""
    length = len(tokens)
    if max_drafts < 1 or length < min_n + 1:
        return []
    arr = np.asarray(tokens, dtype=np.int64)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        # Windows that start early enough to have a token after them (not the suffix itself).
        windows = sliding_window_view(arr[:length - 1], n)
        hits = np.flatnonzero((windows == arr[length - n:]).all(axis=1))
        if len(hits):
            # Copy on from there. A copy that reaches the end copies its own drafts
            # on: the match is one period of a repeating pattern back, and the pattern
            # goes on repeating (a run of one token drafts k of it, not one).
            start = int(hits[-1]) + n
            drafts = arr[start:start + max_drafts].tolist()
            period = length - start
            while len(drafts) < max_drafts:
                drafts.append(drafts[len(drafts) - period])
            return drafts
    return []
