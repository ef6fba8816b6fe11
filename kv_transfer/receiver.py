"""The receiver's (D's) side of a transport: reservations and their epochs, the
quarantine of dead ones, and the memory of released ones that catches a late landing.

D accepts a write only into blocks it reserved for that request and epoch, before the
reservation's deadline. A late write (aborted, expired or unknown request, stale epoch)
is dropped, counted and refused to P. Two-sided transports (tcp, nccl) apply every
byte themselves, so a reservation that dies is Released at once.

One-sided transports (shm, nixl, cuda_ipc) land bytes before D can look at them, so the
blocks of a reservation that dies (aborted, expired, its sender declared gone) are
fenced: quarantined, out of use, until one of two things proves that no write for it
can land any more, and never on a timer:
- the sender's cancel_ack, which it sends only once none of its writes for that
  (request, epoch) is still moving (sender.py), from the same process (its session,
  announced in its hello) that the reservation was sent to. D sends the cancel when
  the reservation dies and again every CANCEL_RESEND_S until the ack comes;
- the sender's process no longer exists: its pid and start time (liveness.py, from
  its hello) checked on this host at each resend, or, where that cannot be checked
  (another host or pid namespace, or no hello read yet), its supervisor's word
  (peer_gone: the supervisors kill a worker before declaring it gone). A sender
  declared gone that still runs (being killed) keeps its blocks fenced until it has
  exited. A sender that says hello again under the same name (restarted) while a
  reservation waits on that name must confirm too: it may have been sent it;
- the sender's refusal of the request before any write (`unwritten`, on its word over
  the worker plane: a prefill worker that has no control connection to us, whose
  cancel_ack could never arrive, refuses the request for that reason).
A sender that lives but never answers (SIGSTOP, wedged) keeps its reservations' blocks
out of use for as long as it lives: the decode worker serves with fewer blocks and sends
that sender no new prompt once its quarantine would starve the pool (remote_kv.py).
Should bytes land after all in released blocks (a bug, or a sender that broke the
protocol), the write's notification says so: D reports `Overwritten` naming the blocks
(it remembers released reservations for cancel_grace_s + timeout_s, at most
MAX_RELEASED), and their user must treat them as corrupt.

Who owns cancellation. Two messages stop a remote prefill; only the transport's frees
blocks.
- The worker channel's `abort` (protocol.Abort; a request id) goes router ->
  decode worker (client gone, stop string, failover) and decode worker -> the prefill
  worker it sent the prompt to (it ended that request, or gives up altogether). The
  prefill worker ends the job: no more compute, no new write, and its transport's
  cancel(req) (below). It never frees a block by itself, and it is advisory for the
  transfer: lost, the prefill worker still stops at its next write, which is refused.
- The transport's `cancel` (protocol/kv_control.py Cancel: request, epoch, the reservation's deadline)
  goes D's transport -> P's transport, one-sided transports only, whenever a
  reservation dies: abort() here (the decode worker aborting a request that waits for
  its KV, or falling back after P reported a failure in `prefill_done`), its expiry,
  and again every CANCEL_RESEND_S while quarantined, and in reply to every write for a
  quarantined or released reservation. It goes to the reservation's sender (named at
  expect(), else its first writer; with neither, to every sender that said hello,
  each of which must then confirm or be gone). P then refuses that (request,
  epoch), fails its writes not yet notified once their bytes have landed, and replies
  cancel_ack once none can land any more.
- KVTransport.cancel(req) on P sends nothing: the prefill worker calls it whenever a
  job ends early (an abort, a failed step or write, a dead or restarted peer).
Authoritative for freeing blocks: on D, `Released` (after cancel_ack or the sender's
death; at once when two-sided), on which alone the
decode worker frees or reuses a reserved block; on P, each write's WriteDone /
WriteFailed, on which the prefill worker drops its hold on the source blocks. So an
abort travels both ways on purpose: the worker `abort` stops P's compute early (for
two-sided transports, which send no cancel, it is the only early stop), and the
transport's `cancel` is what makes D's blocks safe to reuse.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any, Protocol

import torch

from kv_transfer.compat import KVCompat
from kv_transfer.control import ControlPlane
from kv_transfer.events import Completed, Event, Expired, Overwritten, Received, Released
from kv_transfer.liveness import ProcessId, is_gone
from kv_transfer.rank_pairs import check_wire
from kv_transfer.reservation import Reservation, check_layers, check_masks, covered
from protocol import encode
from protocol.kv_control import Ack, Cancel, Layers, Piece, Run, Written

logger = logging.getLogger(__name__)

# D remembers at most this many released one-sided reservations (their blocks), to name
# the blocks a write landing after all overwrote (Overwritten); the oldest go first.
MAX_RELEASED = 4096
# How often a quarantined reservation's cancel is sent again (a lost message, a sender
# that was stopped), and its sender's process checked.
CANCEL_RESEND_S = 0.5


class ReceiverPlane(Protocol):
    """What the receiver needs of its transport: the data-plane hooks base.py declares."""

    one_sided: bool

    @property
    def registered_cache(self) -> torch.Tensor: ...
    @property
    def registered_compat(self) -> KVCompat: ...

    def _apply(self, sender: str, xfer: int, runs: Sequence[Run], pieces: Sequence[Piece],
               frames: list[Any], layers: Layers | None) -> None: ...
    def _discard(self, sender: str, xfer: int, runs: Sequence[Run], layers: Layers | None) -> None: ...


class ReceiverState:
    """Every reservation of one transport object, from expect() to Completed or Released."""

    def __init__(self, plane: ReceiverPlane, control: ControlPlane, timeout_s: float, cancel_grace_s: float,
                 events: list[Event], stats: dict[str, int]) -> None:
        self._plane = plane
        self._control = control
        self._timeout_s = timeout_s
        self._cancel_grace_s = cancel_grace_s
        self._events = events  # shared with the transport, which hands them out in poll()
        self._stats = stats
        self.reservations: dict[str, Reservation] = {}  # live, by request
        self.quarantine: dict[tuple[str, int], Reservation] = {}  # dead, not yet released
        self.senders: dict[str, tuple[str, ProcessId]] = {}  # agent name -> (session, process): hellos
        # One-sided: released (req, epoch) -> (its blocks, its deadline, until when a
        # write landing for it is reported as Overwritten), oldest first, MAX_RELEASED at most.
        self._released: OrderedDict[tuple[str, int], tuple[tuple[int, ...], float, float, bool]] = OrderedDict()
        # (req, epoch) whose dropped writes were logged: one warning each (a layer-wise
        # stream has a write per layer group in flight when its reservation dies), the
        # rest at debug; the most recent MAX_RELEASED.
        self._drops_logged: OrderedDict[tuple[str, int], None] = OrderedDict()

    def expect(self, req: str, epoch: int, blocks: Sequence[int], deadline: float, sender: str | None,
               layer_masks: Sequence[int] | None = None) -> None:
        """KVTransport.expect."""
        if req in self.reservations:
            raise ValueError(f"request {req!r} already has a live reservation")
        num_blocks = self._plane.registered_cache.shape[0]
        bad = [b for b in blocks if not (isinstance(b, int) and 0 <= b < num_blocks)]
        if bad or not blocks:
            raise ValueError(f"reserved block ids must be in [0, {num_blocks}), got {list(blocks)[:5]}")
        num_layers = self._plane.registered_compat.num_layers
        if problem := check_masks(layer_masks, len(blocks), num_layers):
            raise ValueError(problem)
        self.reservations[req] = Reservation.of(epoch, blocks, deadline, sender, num_layers, layer_masks)

    def holds(self) -> bool:
        return bool(self.reservations or self.quarantine)

    def quarantined_blocks(self) -> int:
        return sum(len(r.blocks) for r in self.quarantine.values())

    def abort(self, req: str) -> None:
        r = self.reservations.pop(req, None)
        if r is not None:
            self._kill(req, r)

    def _kill(self, req: str, r: Reservation) -> None:
        if not self._plane.one_sided:  # we apply every byte ourselves: nothing can land any more
            self._events.append(Released(req, r.epoch, tuple(sorted(r.blocks))))
            return
        r.unnamed = r.sender is None
        names = list(self.senders) if r.sender is None else [r.sender]
        r.waiting_on = dict(self._incarnation(name) for name in names)
        r.killed_at = time.monotonic()
        self.quarantine[(req, r.epoch)] = r
        self._send_cancel(req, r)

    def _incarnation(self, name: str) -> tuple[tuple[str, str | None], ProcessId | None]:
        """The process of sender `name` that its last hello named, as a waiting_on
        entry: ((name, session), process), or ((name, None), None) with no hello yet."""
        known = self.senders.get(name)
        return ((name, known[0]), known[1]) if known is not None else ((name, None), None)

    def _send_cancel(self, req: str, r: Reservation) -> None:
        r.cancel_at = time.monotonic() + CANCEL_RESEND_S
        for name in {name for name, _ in r.waiting_on}:
            self._control.send(name, encode(Cancel(req=req, epoch=r.epoch, deadline=r.deadline)))

    def on_hello(self, sender: str, session: str, proc: ProcessId) -> None:
        """A sender connected (again): the process behind its name from now on. A
        reservation that died waiting on that name waits on this process too: it may
        have been sent the request before we read this hello."""
        self.senders[sender] = (session, proc)
        for r in self.quarantine.values():
            if r.unnamed or r.sender == sender:
                r.waiting_on.setdefault((sender, session), proc)

    def on_cancel_ack(self, sender: str, req: str, epoch: int, session: str) -> None:
        """The sender says none of its writes for (req, epoch) can land any more: it
        speaks for its own process (its session), or for a process of its name whose
        hello had not come when the reservation died."""
        r = self.quarantine.get((req, epoch))
        if r is None:
            return
        key = (sender, session) if (sender, session) in r.waiting_on else (sender, None)
        if key not in r.waiting_on:
            logger.info("a cancel_ack for %s/%d from %s (session %s) that the reservation does not wait on",
                        req, epoch, sender, session[:8])
            return
        del r.waiting_on[key]
        self._lift(req, r)

    def unwritten(self, req: str, epoch: int, sender: str) -> None:
        """`sender` refused reservation (req, epoch) before starting any write for it
        (its own word, over the worker plane): it can land nothing there, even if its
        cancel_ack cannot reach us (no control connection to it)."""
        r = self.quarantine.get((req, epoch))
        if r is None:
            return
        for key in [k for k in r.waiting_on if k[0] == sender]:
            del r.waiting_on[key]
        self._lift(req, r)

    def _lift(self, req: str, r: Reservation) -> None:
        """Release `r` once no sender it waits on can write (an unnamed one: not before
        CANCEL_RESEND_S, for the hello of a sender connecting meanwhile)."""
        if not r.waiting_on and not (r.unnamed and time.monotonic() - r.killed_at < CANCEL_RESEND_S):
            self.release(req, r.epoch, proven=not r.unproven)

    def release(self, req: str, epoch: int, proven: bool = False) -> None:
        """Out of quarantine: nothing can land in its blocks any more. `proven`: every
        sender confirmed or was seen gone, so any notification of its writes that
        comes later tells of bytes that landed before the release (nixl's travels
        apart from the cancel_ack, and may come after it)."""
        r = self.quarantine.pop((req, epoch), None)
        if r is not None:
            self._remember_released(req, r, proven)
            self._events.append(Released(req, epoch, tuple(sorted(r.blocks))))

    def _remember_released(self, req: str, r: Reservation, proven: bool) -> None:
        """One-sided: keep the blocks of a released reservation for a while, so that a
        write for it whose bytes land after all is reported (Overwritten) naming them."""
        if not self._plane.one_sided:
            return
        until = time.time() + self._cancel_grace_s + self._timeout_s
        self._released[(req, r.epoch)] = (tuple(sorted(r.blocks)), r.deadline, until, proven)
        self._released.move_to_end((req, r.epoch))
        while len(self._released) > MAX_RELEASED:
            self._released.popitem(last=False)

    @staticmethod
    def _cannot_write(r: Reservation, key: tuple[str, str | None]) -> bool:
        """Can this process of quarantined `r`'s senders no longer write? Checked here
        where possible; elsewhere (another host, no hello), its supervisor's word
        (peer_gone), which both supervisors give only once they killed it."""
        proc = r.waiting_on.get(key)
        if proc is not None:
            gone = is_gone(proc)
            if gone is not None:
                return gone
        if key[0] in r.declared_gone:
            r.unproven = True
            return True
        return False

    def _check_senders(self, req: str, r: Reservation) -> None:
        for key in [k for k in r.waiting_on if self._cannot_write(r, k)]:
            del r.waiting_on[key]
        self._lift(req, r)

    def peer_gone(self, name: str) -> None:
        """Sender `name` is declared gone: its live reservations die (Expired: the caller
        prefills those prompts elsewhere), and every reservation it was writing is
        released once it can no longer write (at once if it has exited)."""
        for req, r in [(q, r) for q, r in self.reservations.items() if r.sender == name]:
            del self.reservations[req]
            self._events.append(Expired(req, r.epoch))
            self._kill(req, r)
        for (req, _), r in list(self.quarantine.items()):
            if any(n == name for n, _ in r.waiting_on):
                r.declared_gone.add(name)
                self._check_senders(req, r)

    def expire(self, now: float) -> None:
        """Each poll: reservations past their deadline die (Expired); quarantined ones
        whose senders have all confirmed or exited are released, the others get their
        cancel again."""
        for req, r in list(self.reservations.items()):
            if now > r.deadline:
                self._stats["expired"] += 1
                del self.reservations[req]
                self._events.append(Expired(req, r.epoch))
                self._kill(req, r)
        mono = time.monotonic()
        for (req, _), r in list(self.quarantine.items()):
            if mono >= r.cancel_at:
                self._check_senders(req, r)
                if (req, r.epoch) in self.quarantine:
                    self._send_cancel(req, r)
        for key in [k for k, (_, _, until, _) in self._released.items() if now > until]:
            del self._released[key]

    def on_written(self, sender: bytes, msg: Written, frames: list[Any]) -> None:
        """A write's notification: accept it (Received for the blocks it completes, then
        Completed once every layer of every block is in) or refuse it, naming why, to
        the sender."""
        req, epoch, blocks = msg.req, msg.epoch, msg.blocks
        r = self.reservations.get(req)
        reason = ""
        if (req, epoch) in self.quarantine:
            fenced = self.quarantine[(req, epoch)]
            reason = "the request was aborted or expired"
            landed = fenced.blocks & (set(blocks) | (covered(msg.runs) or set())) if self._plane.one_sided else set()
            if landed and not fenced.landing_seen:  # into blocks the fence keeps out of use: harmless, said once
                fenced.landing_seen = True
                self._stats["overwritten"] += 1
                logger.warning("a write from %s for %s/%d landed after the reservation was given up, in blocks "
                               "%s, which stay fenced until its sender confirms", sender.decode(), req, epoch,
                               sorted(landed)[:16])
                self._events.append(Overwritten(req, epoch, tuple(sorted(landed)), fenced=True))
            # The cancel may not have reached this sender before: repeat it.
            self._control.send(sender, encode(Cancel(req=req, epoch=epoch, deadline=fenced.deadline)))
        elif self._plane.one_sided and (req, epoch) in self._released:
            released, deadline, _, proven = self._released[(req, epoch)]
            landed = set(released) & (set(blocks) | (covered(msg.runs) or set()))
            reason = "the request's blocks were already released"
            if landed and proven:
                # Its sender confirmed (or was seen gone) before the release: the bytes
                # landed before it, and this notice took another road (nixl's UCX).
                logger.info("a write from %s for %s/%d, released on its sender's confirmation, was notified late",
                            sender.decode(), req, epoch)
            elif landed:  # released on a supervisor's word: the bytes may sit in blocks in use again
                self._stats["overwritten"] += 1
                self._stats["overwritten_in_use"] += 1
                logger.error("a write from %s for %s/%d landed in blocks %s after they were released: "
                             "their contents are unknown", sender.decode(), req, epoch, sorted(landed)[:16])
                self._events.append(Overwritten(req, epoch, tuple(sorted(landed))))
            self._control.send(sender, encode(Cancel(req=req, epoch=epoch, deadline=deadline)))
        elif r is None:
            reason = "no reservation for this request"
        elif r.epoch != epoch:
            reason = f"epoch {epoch} is stale (reserved: {r.epoch})"
        elif not set(blocks) <= r.blocks:
            reason = f"blocks {sorted(set(blocks) - r.blocks)[:5]} were not reserved for it"
        elif time.time() > r.deadline:
            reason = "the reservation's deadline passed"
        elif covered(msg.runs) != set(blocks):
            reason = "its runs do not cover exactly its blocks"
        elif bad_layers := check_layers(msg.layers, self._plane.registered_compat.num_layers):
            reason = bad_layers
        elif bad_pieces := check_wire(msg.pieces, self._plane.registered_compat.local_heads):
            reason = f"its pieces do not fill every head of the blocks: {bad_pieces}"
        if not reason and not self._plane.one_sided:
            try:
                self._plane._apply(sender.decode(), msg.xfer, msg.runs, msg.pieces, frames, msg.layers)
            except (ValueError, RuntimeError) as exc:
                reason = f"unusable data: {exc}"
        elif reason and not self._plane.one_sided and covered(msg.runs) is not None:
            try:
                self._plane._discard(sender.decode(), msg.xfer, msg.runs, msg.layers)
            except (ValueError, RuntimeError) as exc:
                logger.warning("could not drain a refused write's data: %s", exc)
        if reason:
            self._stats["late_writes_dropped"] += 1
            first = (req, epoch) not in self._drops_logged
            self._drops_logged[(req, epoch)] = None
            while len(self._drops_logged) > MAX_RELEASED:
                self._drops_logged.popitem(last=False)
            logger.log(logging.WARNING if first else logging.DEBUG, "dropped a write from %s for %s/%d: %s%s",
                       sender.decode(), req, epoch, reason, "" if first else " (not its first)")
            self._control.send(sender, encode(Ack(xfer=msg.xfer, ok=False, reason=reason)))
            return
        assert r is not None  # else a reason was given above
        if r.sender is None:
            r.sender = sender.decode()
        # Only a block every layer of which has come is Received: a partial one is never runnable.
        whole = r.take(blocks, msg.layers, self._plane.registered_compat.num_layers)
        if whole:
            self._events.append(Received(req, epoch, tuple(whole)))
        self._control.send(sender, encode(Ack(xfer=msg.xfer, ok=True, reason="")))
        if not r.missing:
            del self.reservations[req]
            self._events.append(Completed(req, epoch))
