"""Each API key's weighted share of a decode worker's batch (`router.key_weights`), so
that a flooding key cannot take the running batch from a quiet one.

Fair queuing (router/fair_queue.py) orders the queues; it does not stop a key from
filling the batch once its requests are served, and every sequence in a batch shares
its step time. A flood with a loose TPOT target would grow the batch until steps are
as slow as that target allows, and a quiet key's tighter target could then not be met
there: each of its requests would be refused (or degraded) for TPOT.

So SLO admission (any policy but off) asks one more thing of a request, with targets
or without, whose key would hold more than its weighted share of a worker's batch (its
sequences there over all of them, against its weight over the weights of the keys
active there): that the worker could still take the other active keys' demand within
their tightest TPOT targets (less router/admission.py's SHARE_HEADROOM). A key is
active on a worker while it has sequences there or sent it a request in the last
WINDOW_S (one refused for TPOT alone counts: else a flood that filled the batch before
a quiet key came would keep it out for good). Its demand there is its peak open
sequences over the last one to two windows, plus one (its next request); what a key
under its share has not used of that is held for it, within its own tightest TPOT
target of those windows, unless even its demand alone would not meet that target by
the worker's measured steps (nothing is held for a target nothing meets). A key
alone, or within its share, meets no more than its own targets; an idle key holds
nothing after a window.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from router.fair_queue import key_weight

WINDOW_S = 10.0  # how long a key stays active on a worker after its last request there


@dataclass(frozen=True)
class Hold:
    """One key a key over its share must leave room for on a worker: `sequences` more
    rows (what it has not used of its demand), within `tpot_s` (its tightest TPOT
    target). `alone`: the batch its demand makes by itself; a target not met even there
    is held for by no one (a key cannot refuse others for a target nothing meets)."""

    sequences: int
    tpot_s: float
    alone: int


@dataclass
class _Use:
    """One key on one worker."""

    open: int = 0  # sequences not ended
    seen: float = float("-inf")  # time.monotonic() of its latest request
    window: float = float("-inf")  # the current window's start
    peak: int = 0  # most open in the current window
    last_peak: int = 0  # ... in the previous one
    tpot_s: float | None = None  # tightest TPOT target (seconds) in the current window
    last_tpot_s: float | None = None

    def roll(self, now: float) -> None:
        if now - self.window < WINDOW_S:
            return
        recent = now - self.window < 2 * WINDOW_S
        self.last_peak = self.peak if recent else 0
        self.last_tpot_s = self.tpot_s if recent else None
        self.peak, self.tpot_s, self.window = self.open, None, now

    def active(self, now: float) -> bool:
        return self.open > 0 or now - self.seen < WINDOW_S

    def demand(self) -> int:
        return max(self.peak, self.last_peak) + 1

    def tightest(self) -> float | None:
        targets = [t for t in (self.tpot_s, self.last_tpot_s) if t is not None]
        return min(targets) if targets else None


def _least(a: float | None, b: float | None) -> float | None:
    return b if a is None else a if b is None else min(a, b)


class KeyShares:
    """Who calls what: the router's placement asks hold() for each candidate worker of
    each request (with SLO targets or not), and reports each sequence it sends
    (opened), each that ends (closed), and each request its SLO admission refused for
    TPOT alone (wanted, per candidate). Runs on the router's event loop. Without key
    weights, hold() is empty."""

    def __init__(self, weights: Sequence[float] | None) -> None:
        self.weights = tuple(weights) if weights is not None else None
        self._use: dict[str, dict[int | None, _Use]] = {}  # worker -> key position -> its use there

    def weight(self, client: int | None) -> float:
        return key_weight(self.weights, client)

    def opened(self, worker: str, client: int | None, sequences: int, tpot_s: float | None, now: float) -> None:
        """`sequences` of a request of `client` (None: no keys) went to `worker`, with its
        TPOT target (seconds; None: none)."""
        use = self._note(worker, client, sequences, tpot_s, now)
        if use is not None:
            use.open += sequences

    def wanted(self, worker: str, client: int | None, sequences: int, tpot_s: float | None, now: float) -> None:
        """A request as opened()'s was refused there: its key is active there all the
        same, and what it wanted counts in its demand, so that a key over its share makes
        room for the next one (else a flood that filled the batch before a quiet key came
        would keep it out for good)."""
        self._note(worker, client, sequences, tpot_s, now)

    def _note(self, worker: str, client: int | None, sequences: int, tpot_s: float | None,
              now: float) -> _Use | None:
        if self.weights is None:
            return None
        use = self._use.setdefault(worker, {}).setdefault(client, _Use())
        use.roll(now)
        use.seen = now
        use.peak = max(use.peak, use.open + sequences)
        use.tpot_s = _least(use.tpot_s, tpot_s)
        return use

    def closed(self, worker: str, client: int | None, now: float) -> None:
        """One sequence opened() there ended (or left: a failover, an abort)."""
        use = self._use.get(worker, {}).get(client)
        if use is None:
            return
        use.roll(now)
        use.open = max(0, use.open - 1)
        if not use.active(now):
            del self._use[worker][client]

    def forget(self, worker: str) -> None:
        """The worker left its pool: what each key had there goes."""
        self._use.pop(worker, None)

    def hold(self, worker: str, client: int | None, sequences: int, now: float) -> list[Hold]:
        """What a request of `client` adding `sequences` to `worker` must leave free
        there (module doc): one Hold per active key under its share with a TPOT target;
        none when its own key stays within its share."""
        there = self._use.get(worker)
        if self.weights is None or not there:
            return []
        for key, use in list(there.items()):
            use.roll(now)
            if not use.active(now):
                del there[key]
        own = there.get(client)
        mine = (own.open if own is not None else 0) + sequences
        total = sum(u.open for u in there.values()) + sequences
        weights = sum(self.weight(k) for k in there) + (0.0 if client in there else self.weight(client))
        if mine * weights <= self.weight(client) * total:
            return []  # within its share
        holds = []
        for key, use in there.items():
            target = use.tightest()
            if key == client or target is None or use.open * weights >= self.weight(key) * total:
                continue  # itself, a key without a TPOT target, or one at or over its share
            holds.append(Hold(max(0, use.demand() - use.open), target, max(use.demand(), use.open)))
        return holds
