"""Where each prompt of a request goes, and in what order it is served there: the
router's admission (router/admission.py: SLO targets against predicted latency), its
fair queuing across API keys (router/fair_queue.py) and their shares of each decode
worker's batch (router/key_shares.py), and the latency predictor's
bookkeeping (router/predictor.py: what is queued where, and what it learns from each
request's first token and end).

Who calls what: Router.run_batch asks admit() to place every prompt of a request
before any is sent, and Router._submit sends each (a failover is placed again with
place(), not admitted again: it was); a request's sequences report
first_token() and ended() for the Ticket they were submitted under; the router counts
each finished request's SLO outcome (outcome()).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from router.adapters import Adapter
from router.admission import LOWEST_PRIORITY, Candidate, Decision, ShareCheck, decide, misses
from router.errors import APIError
from router.fair_queue import Charge, FairQueue
from router.key_shares import KeyShares
from router.metrics import RouterMetrics
from router.pool import WorkerPool
from router.predictor import LatencyPredictor, Prediction, Ticket
from router.slo import SLOSettings, Targets
from router.worker_client import WorkerClient


@dataclass
class RequestPlan:
    """What one request's placement needs across its prompts and failovers."""

    priority: int  # the client's; LOWEST_PRIORITY once degraded (best_effort: the whole request)
    targets: Targets
    client: int | None  # its API key's position in router.api_keys; None: no keys
    received: float  # time.monotonic() when the router took it (its TTFT runs from there)
    lora: Adapter | None = None  # the LoRA adapter it runs with: workers that hold it are preferred
    placed: list[Placed] = field(default_factory=list)  # admitted, not submitted yet: its prompts', in order


@dataclass(frozen=True)
class Placed:
    worker: WorkerClient
    remote: bool
    cached: int
    priority: int
    tag: float  # fair queuing's start tag (Generate.queue_tag)
    ticket: Ticket
    charge: Charge


class Placement:
    def __init__(self, pool: WorkerPool, metrics: RouterMetrics, slo: SLOSettings | None,
                 key_weights: tuple[float, ...] | None) -> None:
        self.pool, self.metrics = pool, metrics
        self.policy = slo.policy if slo is not None else "off"
        self.fair = FairQueue(key_weights)
        self.shares = KeyShares(key_weights if self.policy != "off" else None)  # an admission rule: none when off
        self.predictor = LatencyPredictor(metrics.observe_prediction_error)
        pool.on_stats = self.predictor.update
        pool.on_removed = self._forget

    def admit(self, prompts: list[list[int]], n: int, plan: RequestPlan, remote_min_tokens: int,
              prompt_logits: bool) -> None:
        """Place every prompt of a request before any is sent (plan.placed), or none: a
        429 for one refuses them all, and what the others were charged is given back.
        `prompt_logits`: it asks for prompt logprobs, which only a local prefill gives."""
        decisions: list[tuple[str, str]] = []
        try:
            for prompt in prompts:
                client_priority = plan.priority
                plan.placed.append(self.place(prompt, n, plan, remote_min_tokens, prompt_logits, decisions))
                if plan.priority != client_priority and len(plan.placed) > 1:
                    # Degraded at a later prompt: a request is degraded whole, so the ones
                    # placed before it are placed again at the lowest priority.
                    self.cancel(plan)
                    decisions.clear()
                    for again in prompts:
                        plan.placed.append(self.place(again, n, plan, remote_min_tokens, prompt_logits, decisions))
                    break
        except BaseException:
            self.cancel(plan)
            for decision, reason in decisions:  # the refusal; the others were never admitted
                if decision == "rejected":
                    self.metrics.admissions.labels(decision=decision, reason=reason).inc()
            raise
        for decision, reason in decisions:
            self.metrics.admissions.labels(decision=decision, reason=reason).inc()

    def cancel(self, plan: RequestPlan) -> None:
        """Give back what the placements not submitted yet took, newest first."""
        for placed in reversed(plan.placed):
            for _ in range(placed.ticket.sequences):
                self._close(placed.ticket, None)
            self.fair.refund(placed.charge)
        plan.placed.clear()

    def place(self, tokens: list[int], n: int, plan: RequestPlan, remote_min_tokens: int, prompt_logits: bool,
              decisions: list[tuple[str, str]] | None = None) -> Placed:
        """The decode worker for prompt `tokens` (sampling n sequences), whether it
        prefills remotely, and its queue order there; 503 with no live worker, 429 when
        the SLO policy rejects it. A failover (decisions None) is not admitted again: it
        goes to the routing policy's choice."""
        now = time.monotonic()
        ranking = self.pool.ranked(tokens, plan.lora)
        prefill = self.pool.live_prefill() if not prompt_logits else []
        tag = self.fair.start(plan.client)
        candidates = [self._candidate(name, cached, tokens, n, (plan.priority, tag), prefill, remote_min_tokens,
                                      plan.client, now) for name, cached in ranking.workers]
        tpot_target = plan.targets.tpot_ms / 1000 if plan.targets.tpot_ms is not None else None
        if decisions is None:
            decision = Decision(candidates[0], False, "failover")
        else:
            try:
                decision = decide(candidates, plan.targets, self.policy, now - plan.received,
                                  lambda d, reason: decisions.append((d, reason)))
            except APIError:
                for c in candidates:  # its key wants room where room is all it lacks
                    if misses(c, plan.targets, now - plan.received)[:2] == (False, True):
                        self.shares.wanted(c.worker, plan.client, n, tpot_target, now)
                raise
        if decision.degraded:
            plan.priority = LOWEST_PRIORITY
        charge = self.fair.charge(plan.client, tag, len(tokens) + n, plan.priority == LOWEST_PRIORITY)
        c = decision.candidate
        worker = self.pool.picked(c.worker, ranking, plan.lora)
        p = c.prediction
        ticket = Ticket(c.worker, c.remote, (plan.priority, tag), len(tokens) - c.cached, n, now,
                        p.ttft_s, p.tpot_s, p.raw_ttft, p.raw_tpot, client=plan.client)
        self.predictor.track(ticket)
        self.shares.opened(c.worker, plan.client, n, tpot_target, now)
        return Placed(worker, c.remote, c.cached, plan.priority, tag, ticket, charge)

    def _candidate(self, worker: str, cached: int, tokens: list[int], n: int, order: tuple[int, float],
                   prefill: list[str], remote_min_tokens: int, client: int | None, now: float) -> Candidate:
        # Conditional disaggregation: only the part the worker must compute counts.
        # This is that rule's one owner; the decode worker only guards it.
        remote = len(tokens) - cached >= remote_min_tokens and bool(prefill)
        prediction = self.predictor.predict(worker, len(tokens) - cached, remote, order, n, prefill)
        return Candidate(worker, cached, remote, prediction, self._share_check(worker, client, n, prediction, now))

    def _share_check(self, worker: str, client: int | None, n: int, prediction: Prediction,
                     now: float) -> ShareCheck | None:
        holds = []
        for hold in self.shares.hold(worker, client, n, now):
            # A target is held for if the worker's measured steps meet it at that key's
            # demand alone. Not the corrected prediction: the correction carries the
            # load of the flood itself, and would drop a target the flood alone makes
            # unattainable.
            alone = self.predictor.tpot_at(worker, hold.alone, corrected=False)
            if alone is not None and alone <= hold.tpot_s:  # else no figures yet, or a target nothing meets
                holds.append(hold)
        if not holds:
            return None
        held = self.predictor.tpot_at(worker, prediction.batch + sum(h.sequences for h in holds))
        return ShareCheck(held, min(h.tpot_s for h in holds)) if held is not None else None

    # --- a submitted prompt's life (router/sequences.py reports) ------------------------

    def first_token(self, ticket: Ticket) -> None:
        if ticket.first_at is None:
            self.fair.done(ticket.order[1], ticket.order[0] == LOWEST_PRIORITY)
            self.predictor.first_token(ticket)

    def ended(self, ticket: Ticket, tpot_s: float | None, transfer_s: float | None) -> None:
        """One sequence submitted under `ticket` ended (or left it: a failover, an abort)."""
        if transfer_s is not None and ticket.open == ticket.sequences:  # its sequences share one transfer
            self.predictor.transfer(transfer_s, ticket.tokens)
        self._close(ticket, tpot_s)
        if ticket.open <= 0 and ticket.first_at is None:
            self.fair.done(ticket.order[1], ticket.order[0] == LOWEST_PRIORITY)
            ticket.first_at = time.monotonic()  # out of the queue: done() once

    def _forget(self, role: str, name: str) -> None:
        """A worker left its pool."""
        self.predictor.forget(role, name)
        self.shares.forget(name)

    def _close(self, ticket: Ticket, tpot_s: float | None) -> None:
        self.predictor.ended(ticket, tpot_s)
        self.shares.closed(ticket.worker, ticket.client, time.monotonic())

    def outcome(self, key: str, targets: Targets, ttft_s: float | None, tpot_s: float | None) -> None:
        """A request finished with every sequence: whether it met its targets, by key
        (met / missed; no_slo without targets). Goodput is the rate of met."""
        if ttft_s is None:
            return
        outcome = "no_slo" if not targets.any else "met" if targets.met(ttft_s, tpot_s) else "missed"
        self.metrics.slo_requests.labels(key=key, outcome=outcome).inc()
