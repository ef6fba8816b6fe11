"""The messages the router, decode workers and prefill workers exchange over ZMQ.

Every worker binds one ROUTER socket; whoever talks to it holds a DEALER whose routing
id is its own name. A worker answers on the socket a message came in on.

    router  -> decode   Generate, Abort, Stats
    decode  -> router   Tokens (one per request per step), Rejected (the request ends
                        there, maybe after tokens), StatsReply
    router  -> prefill  Stats (health and /status only)
    prefill -> router   StatsReply
    decode  -> prefill  RemotePrefill (decode-first push: D's blocks and deadline), Abort
    prefill -> decode   PrefillDone

docs/architecture.md has the catalogue with every field; the field comments below say
what each one means.
"""

from __future__ import annotations

import math
from typing import Annotated

import msgspec

from engine.lora.request import LoRARequest
from protocol.sampling import WireSamplingParams
from protocol.stats import Record, WorkerStats
from protocol.wire import Codec, Message

# One token's log-probability and its top alternatives [(token id, logprob)], best first.
TokenLogprobs = tuple[float, list[tuple[int, float]]]
# A prompt token's (params.prompt_logprobs): its logprob, its rank (1 = most likely), the top ones.
PromptTokenLogprobs = tuple[float, int, list[tuple[int, float]]]
# The router's fair-queuing tag (start-time fair queuing across API keys): a worker's
# queues order by it within a priority, lower first. msgspec's ge=0 refuses nan and
# negatives; inf, which msgpack can carry, _check_tag refuses.
QueueTag = Annotated[float, msgspec.Meta(ge=0)]


def _check_tag(queue_tag: float) -> None:
    # A ValueError in __post_init__ is a ValidationError naming the field when decoded.
    if not math.isfinite(queue_tag):
        raise ValueError(f"queue_tag must be finite, got {queue_tag!r}")


class LoRASpec(Record, frozen=True):
    """The LoRA adapter a request runs with: engine/lora/request.py LoRARequest's fields.
    A worker reads the adapter's files from `path` (the router's registry,
    router/adapters.py, names it) the first time a request names it."""

    name: Annotated[str, msgspec.Meta(min_length=1)]  # what the request's `model` named
    id: Annotated[int, msgspec.Meta(ge=1)]  # unique per adapter registered at the router
    path: Annotated[str, msgspec.Meta(min_length=1)]  # its PEFT directory, on the worker's machine
    # xxh3-64 of its files as the router read them (engine/lora/files.py): a worker runs
    # the request only with those very files (it refuses it if they changed since).
    digest: Annotated[int, msgspec.Meta(ge=0)]

    def request(self) -> LoRARequest:
        """What the engine takes (EngineCore.add_request's lora_request)."""
        return LoRARequest(self.name, self.id, self.path, self.digest)


class Generate(Message, frozen=True, tag="generate"):
    request_id: str  # with params.n > 1: the group's; its sequences are child_request_id(request_id, i)
    prompt: list[int]  # token ids
    # protocol/sampling.py: to_wire(), and from_wire() on arrival.
    params: WireSamplingParams  # type: ignore[valid-type]  # a Struct made at import from SamplingParams' fields
    remote: bool  # the router asks for a remote prefill (the prompt is long enough)
    priority: int = 0  # lower runs first (scheduling_policy: priority)
    queue_tag: QueueTag = 0.0  # within a priority, lower runs first; 0 for all: arrival order
    # The last this many prompt tokens are the request's own output on an earlier worker
    # (a failover): its grammar, if any, goes on after them.
    resumed: int = 0
    lora: LoRASpec | None = None  # run with this LoRA adapter; None: the base model

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_tag(self.queue_tag)


class Abort(Message, frozen=True, tag="abort"):
    """The client went away (router -> decode), or D gave up on a remote prefill
    (decode -> prefill: write no more; kv_transfer/ owns what happens to the blocks)."""

    request_id: str


class Stats(Message, frozen=True, tag="stats"):
    # Echoed in the reply: health pings and /metrics scrapes share one connection.
    seq: int


class StatsReply(Message, frozen=True, tag="stats_reply"):
    seq: int
    stats: WorkerStats  # protocol/stats.py: the worker's figures, health and step histograms
    # Prefix-cache events since the last reply, in order: (block hash, tier: 0 device,
    # 1 host, 2 disk, stored?) (engine/kv_cache/events.py), for the router's kv_aware
    # index. kv_reset: some were dropped; start the index over.
    kv_events: list[tuple[int, Annotated[int, msgspec.Meta(ge=0, le=3)], bool]] = []
    kv_reset: bool = False


class Tokens(Message, frozen=True, tag="tokens"):
    request_id: str
    tokens: list[int]  # new this step
    finished: bool
    reason: str  # why it finished (a RequestStatus value); "" while it runs
    cached: int  # prompt tokens served from the prefix cache
    logprobs: list[TokenLogprobs] = []  # one per new token, when the request asked
    # With the first tokens, when params.prompt_logprobs is set: one per prompt token
    # from the second (the first has none), in order.
    prompt_logprobs: list[PromptTokenLogprobs] = []
    phases: dict[str, float] = {}  # with the last: seconds per phase (router/metrics.py)
    # With the last: its prompt KV came from a prefill worker. (Its phases may lack
    # prefill and transfer: the prefill worker's prefill_done can come after the end of
    # a request whose one token needed only the pushed KV.)
    remote: bool = False


class Rejected(Message, frozen=True, tag="rejected"):
    """The request ends here, maybe after some Tokens."""

    request_id: str
    error: str
    status: int  # 400: its own input or parameters; 500: it failed on the worker
    param: str | None = None  # the request parameter at fault, when the error names one
    # Not the request's fault nor a lasting one (a late KV write overwrote its blocks):
    # the router resubmits it, as after a failover, instead of failing it.
    retry: bool = False


class RemotePrefill(Message, frozen=True, tag="prefill"):
    """What a decode worker D asks of a prefill worker P: compute the KV of every prompt
    token but the last and write it into D's reserved blocks before the deadline."""

    request_id: str
    prompt_token_ids: list[int]
    peer: str  # D's transport agent name
    block_ids: list[int]  # D's blocks for the prompt; block i holds tokens [i*bs, (i+1)*bs)
    # D already holds the KV of blocks before this one (its prefix cache), or never reads
    # it (before its sliding window: those ids are -1)
    first_block: int
    epoch: int  # unique per reservation: a late write for an earlier one is never taken for it
    deadline: float  # time.time() after which D no longer accepts writes
    session: str = ""  # D's KVTransport.session: the blocks belong to that process only
    # The request's Generate.priority and queue_tag: P's queue orders its jobs by them.
    priority: int = 0
    queue_tag: QueueTag = 0.0
    # Per layer, the first block P writes that layer in (a mixed local/global model: the
    # local layers never read blocks before their window at D); empty: every layer of
    # every block from first_block.
    layer_first_blocks: list[int] = []
    # The request's adapter (Generate.lora): P computes the prompt's KV with it, reading
    # it from its path if P holds no read of it yet.
    lora: LoRASpec | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_tag(self.queue_tag)


class PrefillDone(Message, frozen=True, tag="prefill_done"):
    """How a remote prefill ended (prefill -> decode)."""

    request_id: str
    error: str | None  # None: every block was written and acknowledged
    compute_s: float = 0.0  # submit -> prompt KV computed (queue and compute on P)
    transfer_s: float = 0.0  # computed -> last write acknowledged (writes not hidden by compute)
    bytes_written: int = 0
    # The prefill worker refused the request before writing anything (a decode worker
    # it has no KV connection to, a restarted one): for reservation `epoch`, no write
    # can land, so the decode worker need not wait for a cancel_ack that could not come.
    refused_epoch: int | None = None


WORKER_MESSAGES = Codec(Generate, Abort, Stats, StatsReply, Tokens, Rejected, RemotePrefill, PrefillDone)
