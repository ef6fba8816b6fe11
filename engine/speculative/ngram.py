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
    # One pass over the sequence finds where its last min_n tokens occurred earlier
    # (windows that end before its last token); longer n-grams are those matches that
    # extend further back, checked on the matches alone.
    windows = sliding_window_view(arr[:length - 1], min_n)
    hits = np.flatnonzero((windows == arr[length - min_n:]).all(axis=1))
    for extra in range(1, min(max_n, length - 1) - min_n + 1):
        longer = hits[hits >= extra]
        longer = longer[arr[longer - extra] == arr[length - min_n - extra]]
        if not len(longer):
            break
        hits = longer
    if not len(hits):
        return []
    # Copy on from the latest match. A copy that reaches the end copies its own drafts
    # on: the match is one period of a repeating pattern back, and the pattern goes
    # on repeating (a run of one token drafts k of it, not one).
    start = int(hits[-1]) + min_n
    drafts = arr[start:start + max_drafts].tolist()
    period = length - start
    while len(drafts) < max_drafts:
        drafts.append(drafts[len(drafts) - period])
    return drafts
