"""Weighted fair queuing across API keys (`router.key_weights`), so that a key flooding
the deployment cannot starve a quiet one.

Start-time fair queuing (Goyal et al.): each request gets a start tag S = max(V, F_k),
and its key's finish tag becomes F_k = S + cost / weight_k; requests are served in
order of S (within a priority class). A key that sends more than its share runs its
F_k ahead of the others', so its next requests queue behind theirs; a quiet key's
request starts at the virtual time V, at the head of the queue.

The queue itself is not held here: the router sends each request at once with its tag
(Generate.queue_tag), and the decode workers' engines order their waiting requests,
and the prefill workers their jobs, by (priority, tag, arrival). So the fair order
holds where requests actually wait, and no worker idles while the router holds work.
V is the head of that queue: the smallest start tag of the requests still waiting
(before their first token), never moved back. Not the tag of the latest one served:
several workers serve out of tag order (an idle one takes a late tag while earlier
ones wait elsewhere), and a quiet key's request would then start behind tags still
waiting. Requests degraded to the lowest priority (best_effort) wait behind all others
and hold V back for no one. With nothing else waiting, V catches up to the largest
finish tag (every tag issued was served). The cost is the request's prompt tokens plus
one per sequence: a queue position buys a prefill.

Without key_weights every tag is 0: the queues keep arrival order (FCFS), as before.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import NamedTuple


def key_weight(weights: Sequence[float] | None, client: int | None) -> float:
    """A key's weight in `router.key_weights` (by its position; None: no keys), 1.0 where
    none is set."""
    if weights is None or client is None or client >= len(weights):
        return 1.0
    return weights[client]


class Charge(NamedTuple):
    """What charge() changed, to undo it (refund)."""

    client: int | None
    start: float
    finish: float  # the key's finish tag before
    max_finish: float  # the largest finish tag before
    lowest: bool  # charged at the lowest priority (degraded)


class FairQueue:
    """Who calls what: the router asks start() for each request it places, charge()s
    the ones it admits (a rejected request costs its key nothing; refund() takes back
    the charges of a request refused after some of its prompts were placed), and calls
    done(tag, lowest) once an admitted request's first token arrives or it ends without
    one, whichever comes first. Runs on the router's event loop."""

    def __init__(self, weights: Sequence[float] | None) -> None:
        self.weights = tuple(weights) if weights is not None else None
        self._finish: dict[int | None, float] = {}  # key -> its last finish tag
        # (lowest priority?, start tag) of requests before their first token
        self._waiting: Counter[tuple[bool, float]] = Counter()
        self._vtime = 0.0
        self._max_finish = 0.0

    @property
    def enabled(self) -> bool:
        return self.weights is not None

    def weight(self, client: int | None) -> float:
        return key_weight(self.weights, client)

    def virtual_time(self) -> float:
        head = min((tag for lowest, tag in self._waiting if not lowest), default=None)
        self._vtime = max(self._vtime, self._max_finish if head is None else head)
        return self._vtime

    def start(self, client: int | None) -> float:
        """The start tag a request of `client` (its key's position; None: no keys) would
        get now; 0.0 when fair queuing is off. Nothing is charged until charge()."""
        if self.weights is None:
            return 0.0
        return max(self.virtual_time(), self._finish.get(client, 0.0))

    def charge(self, client: int | None, start: float, cost: float, lowest: bool = False) -> Charge:
        """The request was admitted with start tag `start` (start()'s) at `cost` (> 0),
        at the lowest priority or not: its key's finish tag moves on, and it counts as
        waiting until done(start, lowest)."""
        before = Charge(client, start, self._finish.get(client, 0.0), self._max_finish, lowest)
        if self.weights is None:
            return before
        finish = start + cost / self.weight(client)
        self._finish[client] = max(before.finish, finish)
        self._max_finish = max(self._max_finish, finish)
        self._waiting[(lowest, start)] += 1
        return before

    def refund(self, charge: Charge) -> None:
        """Take back the latest charges, newest first (nothing was sent for them): the
        finish tags go back to where they were."""
        if self.weights is None:
            return
        self._finish[charge.client] = charge.finish
        self._max_finish = charge.max_finish
        self.done(charge.start, charge.lowest)

    def tag(self, client: int | None, cost: float, lowest: bool = False) -> float:
        """start() and charge() at once: the tag of a request admitted now."""
        start = self.start(client)
        self.charge(client, start, cost, lowest)
        return start

    def done(self, tag: float, lowest: bool = False) -> None:
        """A request charged with start tag `tag` (at the lowest priority or not) got
        its first token or ended without one: it waits no more (once per charge)."""
        entry = (lowest, tag)
        if self.weights is None or self._waiting[entry] <= 0:
            return
        self._waiting[entry] -= 1
        if not self._waiting[entry]:
            del self._waiting[entry]
