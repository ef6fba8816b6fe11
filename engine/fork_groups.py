"""Parallel sampling (n > 1): a group's prompt KV computed once, shared by its sequences.

The group's prompt request (prefill_only) holds every prompt token but the last; once
their KV is computed (here, or pushed by a prefill worker) it forks: each sequence
takes one more reference on its blocks and computes the last prompt token itself, so
each samples from its own logits with its own generator. The partial last block is
shared until a sequence's first write into it (copy-on-write: KVCacheManager.fork and
allocate_slots). Part of the Scheduler, kept apart to keep each file about one thing.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from engine.errors import EngineStateError
from engine.request import ForkGroup, Request, RequestStatus

if TYPE_CHECKING:
    from engine.kv_cache.manager import KVCacheManager
    from engine.lora.slots import LoRASlots
    from engine.remote_kv import RemoteKVQueues


class ForkGroups:
    """The Scheduler's group verbs; it provides these attributes and helpers."""

    requests: dict[str, Request]
    running: list[Request]
    remote: RemoteKVQueues
    kv: KVCacheManager
    loras: LoRASlots

    if TYPE_CHECKING:  # the Scheduler's helpers these verbs call
        def check_fits(self, num_prompt_tokens: int, max_tokens: int, whole_prompt: bool = False) -> None: ...
        def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> list[Request]: ...
        def push_waiting(self, request: Request) -> None: ...

    def check_group(self, prompt: Request, sequences: Sequence[Request]) -> None:
        """Raise ValueError for a group (n > 1) that could never run, before anything
        of it is queued: each sequence must fit alone (a sequence that cannot get its
        own blocks gives up its shared ones and recomputes, as after a preemption)."""
        taken = [r.request_id for r in [prompt, *sequences] if r.request_id in self.requests]
        if taken:
            raise ValueError(f"request id {taken[0]!r} is already in use")
        for sequence in sequences:
            self.check_fits(sequence.num_prompt_tokens, sequence.sampling_params.max_tokens)

    def add_group(self, prompt: Request, sequences: list[Request]) -> None:
        """Queue a group: `prompt` (prefill_only, every prompt token but the last)
        computes its KV once, then its sequences fork from it (fork)."""
        self.check_group(prompt, sequences)
        self.join_group(prompt, sequences)
        if prompt.num_tokens == 0:  # a one-token prompt: nothing to share
            self.fork(prompt)
            return
        self.requests[prompt.request_id] = prompt
        self.push_waiting(prompt)

    def join_group(self, prompt: Request, sequences: list[Request]) -> None:
        """The sequences wait for `prompt` (queued, or reserved for a remote prefill)."""
        prompt.fork = group = ForkGroup(prompt, sequences)
        for sequence in sequences:
            sequence.fork = group
            sequence.status = RequestStatus.WAITING_FOR_FORK
            self.requests[sequence.request_id] = sequence

    def fork(self, prompt: Request) -> None:
        """The group's prompt KV is computed: each sequence still waiting takes its
        blocks and becomes ready (its first step computes the last prompt token and
        samples); the prompt request ends, giving up its own references."""
        if prompt.status == RequestStatus.RUNNING:
            self.running.remove(prompt)
        self.requests.pop(prompt.request_id, None)
        assert prompt.sequences is not None  # a group's prompt (join_group set them)
        for sequence in prompt.sequences:
            if sequence.status != RequestStatus.WAITING_FOR_FORK:
                continue  # aborted meanwhile
            self.kv.fork(prompt, sequence)
            sequence.num_computed_tokens = prompt.num_computed_tokens
            sequence.num_cached_tokens = prompt.num_cached_tokens
            sequence.remote = None if prompt.remote is None else dataclasses.replace(prompt.remote)
            sequence.first_scheduled_time = prompt.first_scheduled_time
            sequence.block_hashes = list(prompt.block_hashes)
            if sequence.num_computed_tokens:
                self.remote.push_ready(sequence)
            else:
                sequence.status = RequestStatus.WAITING
                self.push_waiting(sequence)
        prompt.status = RequestStatus.FINISHED_STOPPED
        self.kv.free(prompt)
        self.loras.stop(prompt)

    def _drop_unneeded_prompt(self, prompt: Request) -> None:
        """Stop computing a group's prompt once none of its sequences waits for it (not
        while a prefill worker writes into its blocks: it ends when that is over)."""
        fork = prompt.fork
        assert fork is not None and prompt.sequences is not None  # a group's prompt (join_group set them)
        if (prompt.request_id in self.requests and prompt.status != RequestStatus.WAITING_FOR_REMOTE_KV
                and not any(r.status == RequestStatus.WAITING_FOR_FORK for r in prompt.sequences)):
            fork.sequences = []
            self.finish_requests([prompt.request_id], RequestStatus.FINISHED_ABORTED)


    def _unshare_stuck(self, head: Request) -> None:
        """The head of `ready` cannot get the blocks of its first step, nothing runs and
        no step is in flight. Only a forked sequence gets here: it needs a block of its
        own for its first write while queued requests that share theirs hold every
        block, and nothing running will free one. It gives its shared blocks up and
        recomputes its prompt alone, which fits (check_group). Taken out of `ready` by
        identity: by now requests set aside (a grammar still compiling) are back in front
        of it."""
        if not self.remote.discard(head):
            raise EngineStateError(f"stuck request {head.request_id!r} is not in the ready queue")
        self.kv.free(head)
        head.num_computed_tokens = 0
        head.remote = None
        head.status = RequestStatus.WAITING
        self.push_waiting(head)
