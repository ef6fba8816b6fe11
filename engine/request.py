"""A request's token-accounting state inside the engine, and its features' records."""

from __future__ import annotations

import enum
import itertools
import math
import time
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING

import torch

from engine.errors import EngineStateError
from engine.kv_cache.block_hash import NONE_HASH
from engine.sampling import SamplingRow, TokenLogprobs
from engine.sampling_params import SamplingParams

if TYPE_CHECKING:  # xgrammar is imported only by engines that see a structured request
    from engine.lora.adapter import LoRAAdapter
    from engine.structured.matcher import GrammarState


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    WAITING_FOR_REMOTE_KV = "waiting_for_remote_kv"  # decode worker: blocks reserved, KV in flight
    LOADING_KV = "loading_kv"  # its prefix is being loaded back from an offload tier (engine/tier_loads.py)
    RUNNING = "running"
    PREEMPTED = "preempted"
    PREFILLED = "prefilled"  # prefill worker: prompt KV computed, blocks held until written out
    WAITING_FOR_FORK = "waiting_for_fork"  # a sequence of a group (n > 1): its prompt's KV is being computed
    FINISHED_STOPPED = "stop"  # eos, stop token or stop string
    FINISHED_LENGTH = "length"  # max_tokens reached
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                        RequestStatus.FINISHED_ABORTED)


_arrival_counter = itertools.count()

SortKey = tuple[int, float, int]  # Request.sort_key: (priority, queue_tag, arrival_index), lowest first


@dataclass(eq=False)
class Speculation:
    """Speculative decoding's state of one request (engine/speculative): the draft
    tokens its next step verifies after its last token (proposed just before that
    step is scheduled), and how its drafts fared (a request whose drafts are mostly
    rejected stops speculating)."""

    token_ids: list[int] = field(default_factory=list)
    num_draft_computed: int = 0  # draft model: tokens whose draft KV is in its blocks
    num_offered: int = 0  # drafts offered in its current acceptance window
    num_accepted: int = 0  # of those, accepted
    enabled: bool = True


@dataclass(eq=False)
class LoRAUse:
    """A request run with a LoRA adapter (engine/lora): the read of its files it runs
    with until it ends, and the slot it holds while it runs (-1: none)."""

    adapter: LoRAAdapter
    slot: int = -1


@dataclass(eq=False)
class RemoteKV:
    """A decode worker's request whose prompt KV a prefill worker writes into blocks
    reserved for it (engine/remote_kv.py). Dropped when it falls back to a local prefill."""

    num_tokens: int = 0  # prompt tokens whose KV the prefill worker wrote, once it arrived
    # The first block the prefill worker writes: those before are prefix hits here, or
    # no layer reads them (engine/remote_kv.py reserve).
    first_block: int = 0
    # Per layer, the first block the prefill worker writes it in (KVCacheManager.write_by_layer);
    # () : every layer of every block it writes.
    layer_first_blocks: tuple[int, ...] = ()


@dataclass(eq=False)
class ForkGroup:
    """Parallel sampling (n > 1), shared by the group's prompt request and its
    sequences. The prompt request computes the KV of every prompt token but the last
    once, then forks: each sequence takes its blocks (the last, partial one copied on
    its first write) and computes the last token itself (engine/fork_groups.py)."""

    prompt: Request
    sequences: list[Request]


@dataclass(eq=False)
class PromptLogprobs:
    """params.prompt_logprobs: entry j scores prompt token j + 1 (engine/prompt_logprobs.py)."""

    entries: list[TokenLogprobs] = field(default_factory=list)


@dataclass(eq=False)
class Request:
    """One sequence. There is no prefill or decode phase: each step moves
    `num_computed_tokens` (tokens whose KV is in the cache) toward `num_tokens`.

    Invariant: num_computed_tokens <= num_tokens; a step that computes the last token
    samples the next one, so a running request always has >= 1 token to compute.

    Between schedule() and update() a step is in flight: its tokens count in
    `num_scheduled_tokens`, and a token it samples counts in `num_output_placeholders`
    until its id reaches the host. Synchronous steps clear both before the next
    schedule(); with async scheduling the next step is scheduled while one is in flight,
    so its first token may be a placeholder the runner fills in on the device.

    Its fields are what every request has. Each feature keeps its state in one record
    (spec, remote, fork, grammar, prompt_logprobs), None while the feature is off for
    this request: a new feature adds a record, not fields every request carries.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    priority: int = 0  # lower runs first; ties by queue_tag, then arrival
    # The router's fair-queuing tag: within a priority, lower first; 0 for everyone gives arrival order.
    queue_tag: float = 0.0
    arrival_time: float = field(default_factory=time.monotonic)
    first_scheduled_time: float | None = None  # time.monotonic() of its first step (queue time)
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[TokenLogprobs] = field(default_factory=list)  # when params.logprobs is set
    num_computed_tokens: int = 0
    num_scheduled_tokens: int = 0  # in steps scheduled but not yet updated
    num_output_placeholders: int = 0  # sampled by those steps, ids not yet on the host
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache on first schedule
    num_preemptions: int = 0
    prefill_only: bool = False  # prefill worker, or a group's prompt: compute the prompt's KV, never sample
    generator: torch.Generator | None = None
    block_hashes: list[int] = field(default_factory=list)  # of full blocks of all_token_ids
    arrival_index: int = field(default_factory=lambda: next(_arrival_counter))
    # Each feature's state: one record, None while the feature is off for this request.
    spec: Speculation | None = None  # its engine speculates (set by the engine core on every request it makes)
    remote: RemoteKV | None = None  # decode worker: its prompt's KV comes from a prefill worker
    fork: ForkGroup | None = None  # parallel sampling (n > 1): the group it belongs to
    grammar: GrammarState | None = None  # structured outputs: what its tokens must follow
    prompt_logprobs: PromptLogprobs | None = None  # params.prompt_logprobs: set by __post_init__
    lora: LoRAUse | None = None  # run with a LoRA adapter

    def __post_init__(self) -> None:
        self.all_token_ids: list[int] = list(self.prompt_token_ids)
        # Sampling reads the tokens so far while fewer than this many are out: always
        # with penalties or a bad word of several tokens (banned after its prefix), else
        # until min_tokens (eos and stop tokens masked till then).
        params = self.sampling_params
        always = params.has_penalties or any(len(s) > 1 for s in params.bad_words_token_ids)
        self.reads_history_until: float = math.inf if always else params.min_tokens
        if params.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = PromptLogprobs()

    @property
    def hash_root(self) -> int:
        """The parent hash of its first KV block: an adapter's own, so that prefix-cache
        hits never cross adapters (engine/lora/request.py)."""
        return NONE_HASH if self.lora is None else self.lora.adapter.cache_root

    @property
    def sequences(self) -> list[Request] | None:
        """On a group's prompt request: the group's sequences; else None."""
        fork = self.fork
        return fork.sequences if fork is not None and fork.prompt is self else None

    @property
    def group(self) -> Request | None:
        """On a sequence of a group: the group's prompt request; else None."""
        fork = self.fork
        return fork.prompt if fork is not None and fork.prompt is not self else None

    @property
    def num_remote_tokens(self) -> int:
        """Prompt tokens whose KV a prefill worker wrote (decode side)."""
        return 0 if self.remote is None else self.remote.num_tokens

    @property
    def speculation(self) -> Speculation:
        """Its spec, for code that runs only where its engine speculates (which sets it)."""
        if self.spec is None:
            raise EngineStateError(f"request {self.request_id!r} has no speculation state: its engine does not speculate")
        return self.spec

    @property
    def grammar_pending(self) -> bool:
        """Its grammar is still compiling: it is not admitted until it is."""
        return self.grammar is not None and self.grammar.matcher is None

    @property
    def needs_prompt_logprobs(self) -> bool:
        """It asked for prompt logprobs and some are not computed yet: its prompt runs
        through the model from the first token (no prefix-cache hit)."""
        return (self.prompt_logprobs is not None
                and len(self.prompt_logprobs.entries) < len(self.prompt_token_ids) - 1)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_tokens_with_placeholders(self) -> int:
        return len(self.all_token_ids) + self.num_output_placeholders

    @property
    def num_started_tokens(self) -> int:
        """Tokens whose KV is written or being written: where the next step starts."""
        return self.num_computed_tokens + self.num_scheduled_tokens

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    @cached_property
    def sampling_row(self) -> SamplingRow:
        """What the sampler reads of this request. Built once, at its first sample (after
        `generator` is set), and valid from then on: its token lists grow in place."""
        # In a speculating engine, seeded draws are keyed on position (SamplingRow).
        return SamplingRow(self.sampling_params, self.prompt_token_ids, self.output_token_ids,
                           self.generator, self.grammar, self.spec is not None)

    @property
    def sort_key(self) -> SortKey:
        return (self.priority, self.queue_tag, self.arrival_index)
