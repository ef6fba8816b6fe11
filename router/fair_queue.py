"""Weighted fair queuing across API keys (`router.key_weights`), so that a key flooding
the deployment cannot starve a quiet one.

Start-time fair queuing (Goyal et al.): each request gets a start tag S = max(V, F_k),
and its key's finish tag becomes F_k = S + cost / weight_k; requests are served in
order of S (within a priority class). A key that sends more than its share runs its
F_k ahead of the others', so its next requests queue behind theirs; a quiet key's
request starts at the virtual time V, next to the request being served now.

The queue itself is not held here: the router sends each request at once with its tag
(Generate.queue_tag), and the decode workers' engines order their waiting requests,
and the prefill workers their jobs, by (priority, tag, arrival). So the fair order
holds where requests actually wait, and no worker idles while the router holds work.
V is the start tag of the latest request served (its first token came: SFQ's "in
service"), never moved back; with nothing waiting, every tag issued has been served
and V catches up to the largest finish tag. A request that ended unserved (aborted,
failed) moves nothing: its tag may lie deep in the queue. The cost is the request's
prompt tokens plus one per sequence: a queue position buys a prefill.

Without key_weights every tag is 0: the queues keep arrival order (FCFS), as before.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import NamedTuple


class Charge(NamedTuple):
    """What charge() changed, to undo it (refund)."""

    client: int | None
    start: float
    finish: float  # the key's finish tag before
    max_finish: float  # the largest finish tag before


class FairQueue:
    """Who calls what: the router asks start() for each request it places, charge()s
    the ones it admits (a rejected request costs its key nothing; refund() takes back
    the charges of a request refused after some of its prompts were placed), and calls
    done(tag, served) once an admitted request's first token arrives (served) or it
    ends without one, whichever comes first. Runs on the router's event loop."""

    def __init__(self, weights: Sequence[float] | None) -> None:
        self.weights = tuple(weights) if weights is not None else None
        self._finish: dict[int | None, float] = {}  # key -> its last finish tag
        self._waiting: Counter[float] = Counter()  # start tags of requests before their first token
        self._vtime = 0.0
        self._max_finish = 0.0

    @property
    def enabled(self) -> bool:
        return self.weights is not None

    def weight(self, client: int | None) -> float:
        if self.weights is None or client is None or client >= len(self.weights):
            return 1.0
        return self.weights[client]

    def virtual_time(self) -> float:
        if not self._waiting:
            self._vtime = max(self._vtime, self._max_finish)
        return self._vtime

    def start(self, client: int | None) -> float:
        """The start tag a request of `client` (its key's position; None: no keys) would
        get now; 0.0 when fair queuing is off. Nothing is charged until charge()."""
        if self.weights is None:
            return 0.0
        return max(self.virtual_time(), self._finish.get(client, 0.0))

    def charge(self, client: int | None, start: float, cost: float) -> Charge:
        """The request was admitted with start tag `start` (start()'s) at `cost` (> 0):
        its key's finish tag moves on, and it counts as waiting until done(start)."""
        before = Charge(client, start, self._finish.get(client, 0.0), self._max_finish)
        if self.weights is None:
            return before
        finish = start + cost / self.weight(client)
        self._finish[client] = max(before.finish, finish)
        self._max_finish = max(self._max_finish, finish)
        self._waiting[start] += 1
        return before

    def refund(self, charge: Charge) -> None:
        """Take back the latest charges, newest first (nothing was sent for them): the
        finish tags go back to where they were."""
        if self.weights is None:
            return
        self._finish[charge.client] = charge.finish
        self._max_finish = charge.max_finish
        self.done(charge.start, served=False)

    def tag(self, client: int | None, cost: float) -> float:
        """start() and charge() at once: the tag of a request admitted now."""
        start = self.start(client)
        self.charge(client, start, cost)
        return start

    def done(self, tag: float, served: bool) -> None:
        """A request tagged `tag` got its first token (served) or ended without one
        (once per charge)."""
        if self.weights is None or self._waiting[tag] <= 0:
            return
        self._waiting[tag] -= 1
        if not self._waiting[tag]:
            del self._waiting[tag]
        if served:
            self._vtime = max(self._vtime, tag)
