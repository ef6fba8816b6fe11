"""The engine core: model + KV cache + scheduler + sampler, advanced one step at a time.

No tokenizer and no text here: the core speaks token ids, so the same core serves the
offline LLM, a decode worker and a prefill worker.
"""

from __future__ import annotations

import functools
import logging
import os
import weakref

import numpy as np

from engine.builder import build_engine
from engine.config import EngineConfig
from engine.core_types import EngineStats, LayerHook, StepOutput
from engine.distributed.driver import TPDriver
from engine.distributed.sharding import kv_head_range
from engine.errors import EngineStateError, RequestsFailed
from engine.kv_cache.block_pool import KVBlock
from engine.kv_cache.events import Event, KVEvents
from engine.kv_cache.shared_tier import SharedTier
from engine.lora.request import LoRARequest
from engine.prompt_logprobs import PromptRows, plan_rows
from engine.request import Request, RequestStatus
from engine.request_factory import GrammarWatch, RequestFactory
from engine.runner import KVAllocator, LaunchedStep
from engine.sampling import SamplerOutput, UnusableLogitsError
from engine.sampling_params import SamplingParams
from engine.scheduler_output import SchedulerOutput

logger = logging.getLogger(__name__)
class EngineCore:
    def __init__(self, config: EngineConfig, kv_allocator: KVAllocator | None = None,
                 keep_cache_files: bool = False, shared_kv: SharedTier | None = None) -> None:
        """kv_allocator places the KV cache where a KV transport can reach it
        (KVTransport.allocate_kv_cache); None: ordinary device memory. shared_kv: the
        deployment's KV store, below the offload tiers (closed with the engine).

        With tensor_parallel_size > 1 this process is rank 0, the driver: it starts a
        follower process per other rank (engine/distributed). On CPU every rank's cache
        is a file the driver maps too (kv_caches, kv_cache_files), in place of
        kv_allocator's; the files are removed once the followers have mapped them
        unless keep_cache_files (a transport maps them by name), else at close()."""
        self.config = config
        parts = build_engine(config, kv_allocator, keep_cache_files, shared_kv)
        self._resources = parts.resources
        self._finalizer = weakref.finalize(self, parts.resources.close)
        self.model_config, self.shard, self.max_model_len = parts.model_config, parts.shard, parts.max_model_len
        self.model, self.kv_caches, self.kv_cache = parts.model, parts.kv_caches, parts.kv_caches[0]
        self.kv_scales = parts.kv_scales  # an fp8 cache's per-layer (k_scale, v_scale), else ()
        self.kv, self.scheduler, self.runner, self.speculator = parts.kv, parts.scheduler, parts.runner, parts.speculator
        self._in_flight: tuple[SchedulerOutput, LaunchedStep] | None = None  # async scheduling
        self._requests = RequestFactory(config, self.model_config, self.speculator is not None, self._resources)
        self._grammars = GrammarWatch(config.grammar_compile_timeout_s)  # requests whose grammar is compiling
        self._prompt_logprobs: set[Request] = set()  # with prompt logprobs still to compute
        self._kv_events: KVEvents | None = None  # kept once collect_kv_events is called
        self._layer_hook: LayerHook | None = None

    @property
    def tp(self) -> TPDriver | None:
        """The tensor-parallel driver (None at tensor_parallel_size 1)."""
        return self._resources.tp

    @property
    def kv_head_ranges(self) -> list[tuple[int, int]]:
        """The model's KV heads [start, end) each rank's cache holds, rank 0 first."""
        size, heads = self.shard.size, self.model_config.num_kv_heads
        return [kv_head_range(heads, size, rank) for rank in range(size)]

    @property
    def kv_cache_files(self) -> list[str]:
        return list(self._resources.files)  # the rank caches', kept for a transport to map

    def close(self) -> None:
        """Stop the follower ranks, grammar threads and tiers; remove the cache files.
        The engine is unusable afterwards; also run at garbage collection and exit."""
        self._finalizer()

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    priority: int = 0, resumed: int = 0, *, queue_tag: float = 0.0,
                    lora_request: LoRARequest | None = None) -> Request:
        """Queue a request; raises ValueError (and changes nothing) if it can never run.
        It is admitted in (priority, queue_tag, arrival) order, lowest first; `queue_tag`
        (finite, >= 0): the router's fair-queuing tag; `lora_request`: its LoRA adapter.
        `resumed`: the last this many prompt tokens are the request's own output from an
        earlier worker (a failover): its grammar, if it has one, has accepted them. A
        grammar compiles in the background; the request waits for it without holding up
        others, and a grammar that fails to compile fails it at the next step.
        params.n > 1 (parallel sampling): returns the group's prompt request, which the
        caller never sees again; its `sequences` are the n requests that run, sequence i
        named child_request_id(request_id, i) with params.child(i) (engine/fork_groups.py)."""
        if params.n > 1:
            prompt, sequences = self._new_group(request_id, prompt_token_ids, params, priority, resumed, queue_tag,
                                                lora_request)
            self.scheduler.add_group(prompt, sequences)
            for sequence in sequences:
                self._grammars.track(sequence)
            return prompt
        request = self._requests.single(request_id, prompt_token_ids, params, priority, resumed, queue_tag,
                                        lora_request)
        self.scheduler.add_request(request)
        if request.needs_prompt_logprobs:
            self._prompt_logprobs.add(request)
        return self._grammars.track(request)

    def _new_group(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, priority: int,
                   resumed: int, queue_tag: float, lora: LoRARequest | None = None) -> tuple[Request, list[Request]]:
        prompt, sequences = self._requests.group(request_id, prompt_token_ids, params, priority, resumed, queue_tag,
                                                 lora)
        self.scheduler.check_group(prompt, sequences)
        return prompt, sequences

    # --- disaggregation: decode worker side ------------------------------------------

    def add_remote_prefill_request(self, request_id: str, prompt_token_ids: list[int],
                                   params: SamplingParams, priority: int = 0, resumed: int = 0, *,
                                   queue_tag: float = 0.0, lora_request: LoRARequest | None = None) -> Request | None:
        """Reserve blocks for the whole prompt and wait for a prefill worker to write
        its KV. Returns the request (its blocks: kv.block_ids(request_id); tokens
        already cached here: request.num_cached_tokens), or None when the blocks do not
        fit now (prefill locally with add_request instead). Raises ValueError for a
        request that could never run. `resumed`, `queue_tag`, `lora_request`: as for
        add_request (the prefill worker must compute the KV with the same adapter)."""
        if len(prompt_token_ids) < 2:
            raise ValueError("a remote prefill needs a prompt of at least 2 tokens")
        if params.prompt_logprobs is not None:  # a prefill worker sends KV, not logits
            raise ValueError("prompt_logprobs needs the prompt prefilled locally, not remotely")
        if params.n > 1:  # the group's prompt request takes the KV; its sequences fork on arrival
            prompt, sequences = self._new_group(request_id, prompt_token_ids, params, priority, resumed, queue_tag,
                                                lora_request)
            if not self.scheduler.remote.reserve(prompt):
                return None
            self.scheduler.join_group(prompt, sequences)
            for sequence in sequences:
                self._grammars.track(sequence)
            return prompt
        request = self._requests.single(request_id, prompt_token_ids, params, priority, resumed, queue_tag,
                                        lora_request)
        return self._grammars.track(request) if self.scheduler.remote.reserve(request) else None

    def remote_kv_arrived(self, request_id: str) -> None:
        """Every prompt token's KV but the last's is in the reserved blocks."""
        self.scheduler.remote.arrived(self.scheduler.requests[request_id])

    def remote_kv_failed(self, request_id: str) -> None:
        """Prefill locally instead, in new blocks: the request lets go of those it
        reserved. Hold (hold_blocks) and fence any a remote write may still land in
        first: they stay out of use until release_blocks and unfence_blocks."""
        self.scheduler.remote.failed(self.scheduler.requests[request_id])

    def fence_blocks(self, block_ids: list[int]) -> None:
        """A remote KV write may land in these blocks: a step that reads one raises
        EngineStateError instead of computing on them, until unfence_blocks."""
        self.kv.fence(block_ids)

    def unfence_blocks(self, block_ids: list[int]) -> None:
        """Their KV is final (the write completed) or nothing can land any more."""
        self.kv.unfence(block_ids)

    def invalidate_blocks(self, block_ids: list[int]) -> list[str]:
        """The contents of these KV blocks are unknown (a late remote write landed in
        them after their release): they leave the prefix cache. Returns the requests
        holding them, whose KV cannot be trusted: the caller fails them."""
        return self.kv.invalidate(block_ids)

    # --- disaggregation: prefill worker side ------------------------------------------

    def add_prefill_request(self, request_id: str, prompt_token_ids: list[int], priority: int = 0, *,
                            queue_tag: float = 0.0, lora_request: LoRARequest | None = None) -> Request:
        """Compute the KV of these tokens (with `lora_request`'s adapter) and keep it
        (status PREFILLED, reported in StepOutput.finished) until release_prefilled().
        Never samples. Queued in (priority, queue_tag, arrival) order, as add_request's."""
        request = self._requests.single(request_id, prompt_token_ids, SamplingParams(max_tokens=1), priority,
                                        queue_tag=queue_tag, lora=lora_request)
        request.prefill_only = True
        self.scheduler.add_request(request)
        return request

    def set_layer_hook(self, hook: LayerHook | None) -> None:
        """Call hook(layer, computed) after each decoder layer of every step's forward has
        written its KV, from inside the step (None: no more). computed[request_id] is each
        of the step's requests' computed tokens once the step ends: the KV of layers
        0..layer of its tokens below that is in the cache. On CPU the layer has run when
        the hook is called; on CUDA it is queued (a reader waits for the compute stream).
        A streaming prefill worker posts each layer's KV from here (transport_options.stream:
        layer). TP 1 only: the other ranks compute their layers in their own processes."""
        if hook is not None and self.tp is not None:
            raise ValueError(f"a layer hook needs tensor_parallel_size 1 (this engine runs "
                             f"{self.shard.size} ranks, each computing its layers in its own process)")
        self._layer_hook = hook

    def release_prefilled(self, request_id: str) -> None:
        self.scheduler.remote.release_prefilled(request_id)

    def computed_tokens(self, request_id: str) -> int | None:
        """Prompt tokens whose KV is computed (the full blocks among them are final);
        None when the request is not in the engine (finished or aborted)."""
        request = self.scheduler.requests.get(request_id)
        return None if request is None else request.num_computed_tokens

    def is_prefilled(self, request_id: str) -> bool:
        """Every token of an add_prefill_request() is computed, its KV kept."""
        request = self.scheduler.requests.get(request_id)
        return request is not None and request.status == RequestStatus.PREFILLED

    def hold_blocks(self, request_id: str, first: int, end: int) -> list[KVBlock]:
        """One more reference on the request's blocks [first, end), for a reader outside
        the engine's steps (a KV write reading them): they are not reused, even once the
        request lets go of them (preempted, aborted), until release_blocks(them)."""
        return self.kv.hold(request_id, first, end)

    def release_blocks(self, blocks: list[KVBlock]) -> None:
        self.kv.free_blocks(blocks)

    # --- for either role ----------------------------------------------------------------

    def block_ids(self, request_id: str) -> list[int]:
        """The KV blocks the request holds, in order (block i: tokens [i*bs, (i+1)*bs))."""
        return self.kv.block_ids(request_id)

    def check_health(self) -> None:
        """Raise RankFailure if a tensor-parallel rank exited, or, when the group has
        been idle a while, does not answer within distributed_timeout_s (cheap: call it
        on every idle turn of a loop). Nothing at tensor_parallel_size 1."""
        if self.tp is not None:
            self.tp.heartbeat()

    def stats(self) -> EngineStats:
        spec = self.speculator.stats.copy() if self.speculator is not None else None
        return EngineStats(self.kv.pool.num_blocks, self.kv.num_free_blocks, len(self.scheduler.running),
                           self.scheduler.num_waiting, len(self._grammars.compiling),
                           (os.getpid(), *(self.tp.pids if self.tp else ())), self.scheduler.num_preemptions, spec,
                           self.kv.tiers.stats() if self.kv.tiers is not None else None,
                           tuple(self.scheduler.loras.loaded) if self.config.enable_lora else None)

    def collect_kv_events(self, max_per_block: int) -> None:
        """Keep prefix-cache events from now on, for take_kv_events(): at most
        max_per_block per KV block (of every tier) between two takes; beyond that they
        are dropped (nobody is taking them) and the next take says so."""
        if self._kv_events is None:
            slots = sum(i.num_slots for i in self.kv.tiers.indexes) if self.kv.tiers is not None else 0
            self._kv_events = KVEvents(max_per_block * (self.kv.pool.num_blocks + slots))
            self.kv.pool.events = self._kv_events
            if self.kv.tiers is not None:
                self.kv.tiers.collect_events(self._kv_events)

    def take_kv_events(self) -> tuple[list[Event], bool]:
        """The events since the last take, in order, each (block hash, tier, stored:
        engine/kv_cache/events.py), and whether some were dropped since (start the
        index over)."""
        return self._kv_events.take() if self._kv_events is not None else ([], False)

    def abort(self, request_ids: list[str]) -> list[Request]:
        return self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def finish_stopped(self, request_ids: list[str]) -> list[Request]:
        """Finish requests that hit a stop string (detected outside the core)."""
        return self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_STOPPED)

    def has_unfinished(self) -> bool:  # also while a tier load runs: an ended request's holds its blocks
        return self.scheduler.has_unfinished or self._in_flight is not None or self.scheduler.loads.busy

    def has_runnable(self) -> bool:
        """Requests a step can advance: running, or queued (waiting for blocks, a slot,
        or ready to resume), or a launched step to collect; not those only waiting for
        remote KV."""
        return (bool(self.scheduler.running) or self.scheduler.num_waiting > 0 or self._in_flight is not None
                or self.scheduler.loads.busy)

    def step(self) -> StepOutput:
        """Run one step and report the requests it advanced and finished.

        With async scheduling, the step scheduled and launched here is reported by the
        next call: each call schedules step N+1, queues it on the device behind step N,
        and only then waits for step N's tokens and updates the scheduler with them, so
        the host's scheduling and bookkeeping overlap the device's work. A request
        scheduled in N+1 whose token N turns out to stop it costs one wasted row; its
        blocks are freed once N+1 is done. Steps whose sampling reads the tokens so far
        (penalties, min_tokens) run synchronously.
        """
        if self._grammars.compiling:
            self._grammars.check()
        self.scheduler.loads.poll()
        in_flight, self._in_flight = self._in_flight, None
        queued = [in_flight[0]] if in_flight else []
        try:
            if in_flight and in_flight[0].reads_history:
                return self._finish_step(in_flight, queued)  # the next call schedules with every token on the host
            if self.speculator is not None:
                self.speculator.propose(self.scheduler.running)
            out = self.scheduler.schedule()
            if out.scheduled:
                queued.append(out)
                if out.num_draft_tokens:  # a draft model's forwards: their failure voids the step
                    assert self.speculator is not None  # only a speculating engine's requests have drafts
                    self._run(self.speculator.fill, queued, out)
                rows = self._prompt_rows(out)
                launch = self.runner.launch if rows is None else functools.partial(self.runner.launch,
                                                                                   prompt_rows=rows)
                hook = self._layer_hook
                if hook is not None:
                    computed = {s.request.request_id: s.start + s.num_new_tokens for s in out.scheduled}
                    self.model.layer_hook = lambda layer: hook(layer, computed)
                try:
                    launched = self._run(launch, queued, out.scheduled, self._block_tables(out),
                                         in_flight[1] if in_flight else None, out.block_copies)
                finally:
                    self.model.layer_hook = None
                if not self.config.async_scheduling or self.speculator is not None:
                    return self._finish_step((out, launched), queued)
                self._in_flight = (out, launched)
            elif not in_flight and self._grammars.compiling:  # nothing to do but wait for a grammar
                self._grammars.wait(0.01)
            elif not in_flight and self.scheduler.loads.busy:
                self.scheduler.loads.poll(0.01)  # nothing to do but wait for a tier load
            return self._finish_step(in_flight, queued) if in_flight else StepOutput()
        except BaseException as exc:
            # Whatever was queued is void: its requests compute those tokens again, and
            # the caller may abort them. Their blocks are freed at once then, so first
            # let the device finish (or fail) what is queued.
            self._in_flight = None
            self.runner.wait_idle()
            if isinstance(exc, EngineStateError):
                raise
            if isinstance(exc, Exception) and not isinstance(exc, RequestsFailed):
                # The scheduler's own bookkeeping failed part-way: nothing it holds
                # can be trusted, and discarding could only make it worse.
                raise EngineStateError(f"the scheduler failed: {type(exc).__name__}: {exc}") from exc
            for out in queued:
                self.scheduler.discard(out)
            raise

    @staticmethod
    def _run(call, queued: list[SchedulerOutput], *args):
        """Run the model side of a step (`call`: launch, or wait for the result). A
        failure there leaves the scheduler consistent: it is reported as the void
        steps' requests failing (RequestsFailed), so a worker ends just those."""
        try:
            return call(*args)
        except (RequestsFailed, UnusableLogitsError, EngineStateError):
            raise
        except Exception as exc:
            ids = list(dict.fromkeys(s.request.request_id for out in queued for s in out.scheduled))
            raise RequestsFailed(f"the model step failed ({type(exc).__name__}: {exc})", ids) from exc

    def _prompt_rows(self, out: SchedulerOutput) -> PromptRows | None:
        """The step's prompt-logprob rows; nothing at all while no request wants any."""
        if not self._prompt_logprobs:
            return None
        self._prompt_logprobs = {r for r in self._prompt_logprobs
                                 if r.needs_prompt_logprobs and not r.status.finished}
        return plan_rows(out.scheduled, self._prompt_logprobs)

    def _block_tables(self, out: SchedulerOutput) -> np.ndarray:
        return self.kv.block_tables([s.request.request_id for s in out.scheduled])

    def _finish_step(self, step: tuple[SchedulerOutput, LaunchedStep], queued: list[SchedulerOutput]) -> StepOutput:
        """Wait for a step and update the scheduler with its tokens; from then on a
        failure no longer voids it (`queued`: the steps step() would discard)."""
        out, launched = step
        try:
            sampled = self._run(launched.result, queued)
        except UnusableLogitsError as exc:
            # A row per sampling request, and one per draft (runner.sampling_rows).
            owners = [s.request.request_id for s in out.scheduled if s.samples
                      for _ in range(len(s.draft_token_ids) + 1)]
            failed = list(dict.fromkeys(owners[row] for row in exc.rows))
            raise RequestsFailed(f"requests {failed}: {exc}", failed, at_fault=True) from exc
        if launched.prompt_logprobs is not None:
            self._run(launched.prompt_logprobs.land, queued)
        queued.remove(out)
        if out.num_draft_tokens:
            return self._finish_speculative_step(out, sampled)
        if any(sampled.logprobs):  # a C-speed scan; most steps have none
            sampling = [s.request for s in out.scheduled if s.samples]
            for request, logprobs in zip(sampling, sampled.logprobs):
                if logprobs is not None and not request.status.finished:
                    request.output_logprobs.append(logprobs)
        advanced, finished = self.scheduler.update(out, sampled.token_ids)
        return StepOutput(advanced, finished, out.num_tokens, len(out.scheduled))

    def _finish_speculative_step(self, out: SchedulerOutput, sampled: SamplerOutput) -> StepOutput:
        """_finish_step's update for a step with drafts: each request takes the drafts
        it accepted and the token sampled after them (with their logprobs)."""
        speculator = self.speculator
        assert speculator is not None  # only a speculating engine's steps have drafts
        tokens, num_accepted, logprobs = speculator.accepted(out, sampled)
        speculator.record(out, num_accepted)
        sampling = [s.request for s in out.scheduled if s.samples]
        before = [r.num_output_tokens for r in sampling]
        advanced, finished = self.scheduler.update(out, tokens, num_accepted)
        for request, n, entries in zip(sampling, before, logprobs):
            if request.sampling_params.logprobs is not None:  # one per token it took (a stop drops the rest)
                # A row is None only where its request asked for no logprobs: none is dropped here.
                request.output_logprobs += [e for e in entries[:request.num_output_tokens - n] if e is not None]
        return StepOutput(advanced, finished, out.num_tokens, len(out.scheduled))
