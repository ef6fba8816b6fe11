"""The sequences of one request at the router: each sampled sequence's detokenizer, stop
strings, metrics and failover, and the fan-out and merge of a request's sequences.

A request samples params.n sequences from each of its prompts. Each prompt goes to a
decode worker as ONE Generate with that n; the worker answers sequence i under
protocol.child_request_id(id, i) (n = 1: under the id itself) and takes an Abort per
child id. Every sequence's messages land, tagged, in one queue of the request
(`_Inbox`), read by one task in arrival order: the request's chunks come out
interleaved as the sequences produce them. A sequence whose worker died, or that the
worker asked to retry, is resubmitted alone (n=1, params.child(i), prompt + its tokens
so far), exactly as a one-sequence request fails over (Router.run has the rules).

Invariant: a message counts only if it carries the request id its sequence is served
under now; anything from an id it has left (a failover, a retry) is dropped.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from engine.detokenizer import Detokenizer
from engine.sampling_params import SamplingParams
from protocol import Abort, Rejected, Tokens, child_request_id
from router.errors import APIError
from router.metrics import RouterMetrics
from router.predictor import Ticket
from router.worker_client import WORKER_LOST, WorkerClient

# Resubmissions a sequence's decode workers may ask for (Rejected.retry) before it fails.
MAX_RETRIES = 3


@dataclass
class Chunk:
    """What one worker step added to one sequence of a request, detokenized."""

    text: str
    finish_reason: str | None
    num_tokens: int  # the sequence's output tokens so far
    token_ids: list[int] = field(default_factory=list)  # this step's
    logprobs: list[Any] = field(default_factory=list)  # per token of this step, when asked
    worker: str = ""  # the decode worker that sent it (another after a failover)
    # On the last chunk: whether the prompt was prefilled on a prefill worker (the decode
    # worker's last Tokens says so; without it, as when the router ended the request at
    # a stop string: what the router asked for).
    remote_prefill: bool | None = None
    # The sequence: prompt_index * params.n + its index among its prompt's sequences.
    index: int = 0
    cached: int = 0  # of the sequence's prompt, tokens the decode worker found in its prefix cache
    # The request's first chunk, before any token: it was admitted (checked, submitted to
    # a decode worker, `worker`); a stream's headers go out on it. Carries nothing else.
    admission: bool = False
    # On a sequence's first chunk, with params.prompt_logprobs: [logprob, rank, top] per
    # prompt token from the second (router/logprobs.py shapes them).
    prompt_logprobs: list[Any] | None = None
    vllm_prompt_logprobs: list | None = None  # the choice's `prompt_logprobs`, when asked (router/logprobs.py)


# (worker, request id, whether it was asked to prefill remotely, its ticket): Router._submit's answer.
Submit = Callable[[list[int], list[int], SamplingParams, bool], tuple[WorkerClient, str, bool, Ticket]]


class Tracker(Protocol):
    """Who hears of each submission's progress (router/placement.py Placement)."""

    def first_token(self, ticket: Ticket) -> None: ...

    def ended(self, ticket: Ticket, tpot_s: float | None, transfer_s: float | None) -> None: ...


class _Untracked:
    """A group nobody tracks (tests building one alone)."""

    def first_token(self, ticket: Ticket) -> None:
        pass

    def ended(self, ticket: Ticket, tpot_s: float | None, transfer_s: float | None) -> None:
        pass


class _Inbox:
    """What a WorkerClient takes for a request's inbox: it tags each message with the
    sequence (None: the group's own id) and the id it came under."""

    def __init__(self, queue: asyncio.Queue, seq: _Sequence | None, request_id: str) -> None:
        self.queue, self.seq, self.request_id = queue, seq, request_id

    def put_nowait(self, msg: Any) -> None:
        self.queue.put_nowait((self.seq, self.request_id, msg))


class _Sequence:
    def __init__(self, index: int, prompt: list[int], params: SamplingParams, tokenizer: Any) -> None:
        self.index, self.prompt, self.params = index, prompt, params  # params: this sequence's own (n=1)
        self.detok = Detokenizer.for_params(tokenizer, params)
        self.worker: WorkerClient | None = None
        self.request_id = ""
        self.remote = False  # asked to prefill remotely
        self.finished = False
        self.retries = 0
        self.first = self.last = 0.0
        self.cached = 0
        self.ticket: Ticket | None = None  # what it was last submitted under
        self.ticket_tokens = 0  # its output tokens before that submission
        self.ticket_first = 0.0  # when that submission's first token came

    @property
    def worker_name(self) -> str:
        """The decode worker it is attached to ("" before its first submit)."""
        return self.worker.name if self.worker is not None else ""


class SequenceGroup:
    """One request's sequences. Who calls what: Router.run builds it, calls submit()
    once (errors: the request's status), then reads chunks() to the end or closes it
    (close() always, however it ended)."""

    def __init__(self, prompts: list[list[int]], params: SamplingParams, tokenizer: Any, submit: Submit,
                 metrics: RouterMetrics, tracker: Tracker | None = None) -> None:
        self.params, self._submit, self.metrics = params, submit, metrics
        self.tracker = tracker or _Untracked()
        self.n = params.n
        # n == 1: the request's own params (built once, router/parsing.py); a group's
        # sequences each their own (seed + index).
        self.seqs = [_Sequence(p * self.n + i, prompt, params.child(i) if self.n > 1 else params, tokenizer)
                     for p, prompt in enumerate(prompts) for i in range(self.n)]
        self.inbox: asyncio.Queue = asyncio.Queue()
        self.groups: list[tuple[WorkerClient, str]] = []  # each prompt's Generate, while its children run
        self._cached_counted: set[int] = set()  # prompts whose prefix-cache hit is in the metrics
        self.start = time.monotonic()
        self.started = False  # a token chunk went out: an error now breaks a started answer
        self.error = False

    def submit(self) -> None:
        """Each prompt's Generate for all its sequences."""
        for p in range(len(self.seqs) // self.n):
            seqs = self.seqs[p * self.n:(p + 1) * self.n]
            worker, rid, remote, ticket = self._submit(seqs[0].prompt, [], self.params, False)
            if self.n == 1:
                self._attach(seqs[0], worker, rid, remote, ticket)
                continue
            worker.subscribe(rid, _Inbox(self.inbox, None, rid), group=True)  # a rejection of the whole group
            self.groups.append((worker, rid))
            for i, seq in enumerate(seqs):
                self._attach(seq, worker, child_request_id(rid, i), remote, ticket)

    def _attach(self, seq: _Sequence, worker: WorkerClient, request_id: str, remote: bool, ticket: Ticket) -> None:
        seq.worker, seq.request_id, seq.remote = worker, request_id, remote
        seq.ticket, seq.ticket_tokens, seq.ticket_first = ticket, seq.detok.num_tokens, 0.0
        worker.subscribe(request_id, _Inbox(self.inbox, seq, request_id))

    def _leave(self, seq: _Sequence, abort: bool, tpot_s: float | None = None,
               transfer_s: float | None = None) -> None:
        """Stop listening to the sequence's current id; abort it there (it runs on).
        Its ticket ends (tpot_s, transfer_s: what it measured, when it finished)."""
        if seq.ticket is not None:
            self.tracker.ended(seq.ticket, tpot_s, transfer_s)
            seq.ticket = None
        if seq.worker is None:
            return
        seq.worker.unsubscribe(seq.request_id)
        if abort:
            seq.worker.send(Abort(request_id=seq.request_id))

    @property
    def worker(self) -> str:
        return self.seqs[0].worker_name

    async def chunks(self) -> AsyncGenerator[Chunk, None]:
        """Every sequence's chunks as they come, until each has finished."""
        left = len(self.seqs)
        while left:
            seq, request_id, msg = await self.inbox.get()
            if seq is None:  # the group's own id: only a rejection of every sequence means anything
                if isinstance(msg, Rejected):
                    raise _rejection(msg)
                continue
            if seq.finished or request_id != seq.request_id:
                continue  # from an id it has left
            if msg is WORKER_LOST or (isinstance(msg, Rejected) and msg.retry and seq.retries < MAX_RETRIES):
                seq.retries += isinstance(msg, Rejected)
                chunk = self._resubmit(seq)
            elif isinstance(msg, Rejected):
                seq.finished = True  # nothing to abort: the worker ended it (or never queued it)
                self._leave(seq, abort=False)
                raise _rejection(msg)
            else:
                chunk = self._step(seq, msg)
            if chunk is not None:
                left -= chunk.finish_reason is not None
                self.started = True
                yield chunk

    def _resubmit(self, seq: _Sequence) -> Chunk | None:
        """Its worker died (or asked for a retry): leave it, resubmit the sequence alone."""
        self._leave(seq, abort=True)  # in case it was only slow
        if seq.params.max_tokens - seq.detok.num_tokens < 1:  # cannot happen: the last batch says finished
            seq.finished = True
            return Chunk(seq.detok.flush(), "length", seq.detok.num_tokens, worker=seq.worker_name,
                         index=seq.index, cached=seq.cached)
        self._attach(seq, *self._submit(seq.prompt, seq.detok.ids, seq.params, True))
        return None

    def _step(self, seq: _Sequence, msg: Tokens) -> Chunk:
        m, detok = self.metrics, seq.detok
        now, new = time.monotonic(), len(msg.tokens)
        if new and seq.ticket is not None and seq.ticket.first_at is None:
            self.tracker.first_token(seq.ticket)
        if new and seq.ticket_first == 0.0:
            seq.ticket_first = now
        if new and detok.num_tokens == 0:
            m.ttft.observe(now - self.start)
            seq.first = now
        elif new:  # a batch of tokens from one step: each waited its share
            for _ in range(new):
                m.itl.observe((now - seq.last) / new)
        if new:
            seq.last = now
            m.generation_tokens.inc(new)
        seq.cached = max(seq.cached, min(msg.cached, len(seq.prompt)))  # a failover's prompt holds its tokens
        before = detok.num_tokens
        delta, stopped = detok.add(msg.tokens)
        tokens, logprobs = msg.tokens, msg.logprobs
        if stopped:  # a speculative step's tokens after the one that completed the stop string are not output
            taken = detok.num_tokens - before
            tokens, logprobs = tokens[:taken], logprobs[:taken]
        finished = msg.finished or stopped
        reason = "stop" if stopped else (msg.reason if msg.finished else None)
        if finished:
            seq.finished = True
            on_ticket = detok.num_tokens - seq.ticket_tokens
            tpot = (now - seq.ticket_first) / (on_ticket - 1) if on_ticket > 1 else None
            # The KV transfer proper (P's KV computed -> last write acknowledged): the
            # transfer phase also holds P's wait for the step it was in, which is queueing.
            transfer = msg.phases.get("kv_write") if msg.remote else None
            self._leave(seq, abort=stopped, tpot_s=tpot, transfer_s=transfer)  # a stop string ends it here
            delta += detok.flush()
            e2e = now - self.start
            m.e2e.observe(e2e)
            m.observe_tpot(e2e, seq.first - self.start, detok.num_tokens)
            m.finished.labels(reason=reason).inc()
            m.observe_phases(msg.phases, msg.remote)
            prompt = seq.index // self.n
            if prompt not in self._cached_counted:
                self._cached_counted.add(prompt)
                m.prefix_cached_tokens.inc(msg.cached)
        return Chunk(delta, reason, detok.num_tokens, tokens, logprobs, seq.worker_name,
                     (msg.remote if msg.phases else seq.remote) if finished else None, seq.index, seq.cached,
                     prompt_logprobs=msg.prompt_logprobs or None)

    def close(self) -> None:
        """However the request ended: abort every sequence still running (the client
        went away, or the request failed) and stop listening."""
        unfinished = [s for s in self.seqs if not s.finished]
        for seq in unfinished:
            self._leave(seq, abort=True)
        for worker, rid in self.groups:
            worker.unsubscribe(rid)
        if unfinished and self.seqs[0].worker is not None and not self.error:
            self.metrics.finished.labels(reason="abort").inc()

    def latencies(self) -> tuple[float | None, float | None]:
        """The request's TTFT (its first token of any sequence) and its worst sequence's
        TPOT (None: no sequence had two tokens), seconds; (None, None) before a token."""
        firsts = [s.first for s in self.seqs if s.first]
        if not firsts:
            return None, None
        tpots = [(s.last - s.first) / (s.detok.num_tokens - 1) for s in self.seqs if s.detok.num_tokens > 1]
        return min(firsts) - self.start, max(tpots, default=None)


def admission(group: SequenceGroup) -> Chunk:
    return Chunk("", None, 0, worker=group.worker, admission=True)


def _rejection(msg: Rejected) -> APIError:
    """A decode worker's Rejected: 400, bad input; 500, the request failed on the
    worker (its engine step failed, or the worker itself did)."""
    status = msg.status if 400 <= msg.status <= 599 else 500
    if status >= 500:
        return APIError(status, f"the request failed on the server: {msg.error}", kind="internal_server_error")
    return APIError(status, msg.error, msg.param)
