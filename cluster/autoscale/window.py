"""What happened between two LoadSnapshots, in the figures the planner's rules read:
rates and p90 latencies over the window, and the pools' queue and KV figures as the
newer snapshot has them. Pure arithmetic; no decision is taken here."""

from __future__ import annotations

from dataclasses import dataclass

from router.load import LoadSnapshot, quantile_between


@dataclass(frozen=True)
class Window:
    seconds: float  # new.at - old.at, > 0
    requests: float  # routed within the window
    request_rate: float  # per second
    prompt_rate: float  # prompt tokens routed per second
    generation_rate: float  # tokens generated per second
    ttft_p90: float | None  # None: no first token in the window
    tpot_p90: float | None  # None: no request with two tokens finished in the window
    # p90 time between two streamed tokens: TPOT as the requests still running feel it,
    # seen within the window rather than when they finish; None: no token followed another.
    itl_p90: float | None
    prefill_rate: float  # prompt tokens/s the prefill workers computed (remote prefill's own load)
    # Every prefill worker taking work answered in both snapshots: prefill_rate counts
    # all of them (else a silent one reads as computing nothing).
    prefill_counted: bool
    prompt_p50: float | None  # the median prompt length routed in the window; None: no prompt
    prompt_p75: float | None  # its upper quartile
    prompt_max: float | None  # the upper bound of the longest prompt's histogram bucket
    in_flight: int  # requests the router serves now
    decode_kv: float | None  # mean KV usage of the answering decode workers; None: none answered
    decode_waiting: int  # requests in the decode workers' engine queues
    prefill_in_flight: int  # remote prefills in flight (see measure())
    all_answered: bool  # every worker taking work answered its stats ask
    min_tokens: int  # router.remote_prefill_min_tokens in force

    @property
    def idle(self) -> bool:
        return self.requests == 0 and self.in_flight == 0

    @property
    def prefill_unused(self) -> bool:
        """The prefill workers computed nothing and hold no job, as far as all of them
        answered: the decode workers prefilled every prompt of the window."""
        return self.prefill_counted and not self.prefill_rate and not self.prefill_in_flight

    @property
    def long_prompts(self) -> bool:
        """A prompt of the window may have reached the remote-prefill threshold (its
        bucket's bound does); False with none routed."""
        return self.prompt_max is not None and self.prompt_max > self.min_tokens


def measure(old: LoadSnapshot, new: LoadSnapshot) -> Window | None:
    """The window from old to new; None if it is empty (new not after old)."""
    seconds = new.at - old.at
    if seconds <= 0:
        return None
    decode, prefill = new.pool("decode"), new.pool("prefill")
    answered = [w.kv_used for w in decode if w.answered]
    # One remote prefill is a job on its prefill worker and a request waiting for KV on
    # its decode worker: the larger of the two counts still counts it when one side
    # did not answer.
    in_flight = max(sum(w.jobs for w in prefill), sum(w.waiting_for_kv for w in decode))
    requests = max(0.0, new.requests - old.requests)
    # Per worker, between its two answers (a worker added in the window counts from the
    # snapshot that first saw it; one that did not answer, not at all). A count that went
    # down is a restart under the same name: what it counts now is all new.
    before = {w.name: w.tokens_computed for w in old.workers if w.role == "prefill" and w.answered}
    computed = sum(w.tokens_computed - before[w.name] if w.tokens_computed >= before[w.name] else w.tokens_computed
                   for w in new.workers if w.role == "prefill" and w.answered and w.name in before)
    counted = all(w.answered and w.name in before for w in new.pool("prefill"))
    return Window(
        seconds=seconds, requests=requests, request_rate=requests / seconds,
        prompt_rate=max(0.0, new.prompt_tokens - old.prompt_tokens) / seconds,
        generation_rate=max(0.0, new.generation_tokens - old.generation_tokens) / seconds,
        ttft_p90=quantile_between(old.ttft, new.ttft, 0.9), tpot_p90=quantile_between(old.tpot, new.tpot, 0.9),
        itl_p90=quantile_between(old.itl, new.itl, 0.9), prefill_rate=computed / seconds, prefill_counted=counted,
        prompt_p50=quantile_between(old.prompt_lengths, new.prompt_lengths, 0.5),
        prompt_p75=quantile_between(old.prompt_lengths, new.prompt_lengths, 0.75),
        prompt_max=quantile_between(old.prompt_lengths, new.prompt_lengths, 1.0),
        in_flight=new.in_flight, decode_kv=sum(answered) / len(answered) if answered else None,
        decode_waiting=sum(w.waiting for w in decode), prefill_in_flight=in_flight,
        all_answered=all(w.answered for w in decode + prefill), min_tokens=new.remote_prefill_min_tokens)
