"""The engine core: model + KV cache + scheduler + sampler, advanced one step at a time.

No tokenizer and no text here: the core speaks token ids, so the same core serves the
offline LLM, a decode worker and a prefill worker.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import os
import time
import weakref
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from engine.attention.backend import AttentionBackend
from engine.config import EngineConfig
from engine.distributed import shared_cache
from engine.distributed.driver import TPDriver
from engine.distributed.group import SINGLE
from engine.distributed.rank_model import build_rank_model, step_codec
from engine.distributed.sharding import Shard, kv_head_range
from engine.errors import EngineStateError, RequestsFailed
from engine.gpu_memory import profile_num_kv_blocks
from engine.kv_cache.block_pool import KVBlock
from engine.kv_cache.manager import KVCacheManager
from engine.model.config import ModelConfig, max_model_len
from engine.model.loader import TORCH_DTYPES
from engine.prompt_logprobs import PromptRows, plan_rows
from engine.request import Request, RequestStatus
from engine.runner import KVAllocator, LaunchedStep, ModelRunner, allocate_kv_cache, kv_cache_shape
from engine.sampling import Sampler, SamplerOutput, UnusableLogitsError, make_generator
from engine.sampling_params import SamplingParams, SamplingParamsError, child_request_id
from engine.scheduler import Scheduler
from engine.scheduler_output import SchedulerOutput
from engine.speculative.draft_model import DraftModelProposer, LoadedDraft, load_draft
from engine.speculative.speculator import SpecStats, Speculator

logger = logging.getLogger(__name__)


@dataclass
class StepOutput:
    advanced: list[Request] = field(default_factory=list)  # got a new token this step
    finished: list[Request] = field(default_factory=list)  # finished this step (blocks freed, or once no queued step writes them)
    num_tokens: int = 0  # tokens computed this step
    num_requests: int = 0  # requests scheduled in this step (its batch)


@dataclass(frozen=True)
class EngineStats:
    """What a worker reports of its engine (its stats replies, /status)."""

    num_blocks: int
    free_blocks: int
    running: int  # requests scheduled in the last step or about to be
    waiting: int  # queued: waiting for blocks or a slot, or ready to resume
    compiling: int = 0  # of those, waiting for their grammar (bounded by grammar_compile_timeout_s)
    ranks: tuple[int, ...] = ()  # the process id of each tensor-parallel rank, rank 0 first
    preemptions: int = 0  # running requests preempted so far (their blocks freed; they recompute)
    spec: SpecStats | None = None  # speculative decoding's counters so far (a copy); None: not speculating


class EngineCore:
    def __init__(self, config: EngineConfig, kv_allocator: KVAllocator | None = None,
                 keep_cache_files: bool = False) -> None:
        """kv_allocator places the KV cache where a KV transport can reach it
        (KVTransport.allocate_kv_cache); None: ordinary device memory.

        With tensor_parallel_size > 1 this process is rank 0, the driver: it starts a
        follower process per other rank (engine/distributed). On CPU every rank's cache
        is a file the driver maps too (kv_caches, kv_cache_files), in place of
        kv_allocator's; the files are removed once the followers have mapped them
        unless keep_cache_files (a transport maps them by name), else at close()."""
        self.config = config
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        self.model_config = ModelConfig.from_model_dir(config.model)
        self.shard = Shard.of(self.model_config, 0, config.tensor_parallel_size)  # refuses an unshardable model
        self.max_model_len = model_len = max_model_len(config, self.model_config)
        self._group = _GroupResources()
        self._finalizer = weakref.finalize(self, self._group.close)
        try:
            if config.tensor_parallel_size > 1:
                self._group.tp = TPDriver(config, step_codec(config, model_len))
            self.model, _, backend, _ = build_rank_model(config, 0, self.tp.group if self.tp else SINGLE)
            draft = self._load_draft(model_len)  # before the pool is sized: on CUDA it counts the draft
            num_blocks = config.num_kv_blocks or self._pool_blocks(backend, TORCH_DTYPES[config.dtype], model_len,
                                                                   draft)
            self.kv_caches = self._allocate_caches(num_blocks, kv_allocator, keep_cache_files)
        except BaseException:
            self.close()
            raise
        self.kv_cache = self.kv_caches[0]
        self.kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.kv, config.max_num_batched_tokens, config.max_num_seqs,
                                   model_len, self.model_config.eos_token_ids,
                                   config.enable_chunked_prefill)
        self.runner = ModelRunner(self.model, self.kv_cache, config.block_size,
                                  Sampler(self.model_config.eos_token_ids, seed=config.seed),
                                  backend, config.device, self.tp)
        if config.device.startswith("cuda") and not config.enforce_eager:
            if self.tp is None:
                self._capture_cuda_graphs(backend, model_len)
            else:
                logger.info("no CUDA graphs at tensor_parallel_size > 1: the ranks run eagerly")
        self.speculator = self._speculator(num_blocks, model_len, draft)
        self._in_flight: tuple[SchedulerOutput, LaunchedStep] | None = None  # async scheduling
        self._compiling: dict[str, Request] = {}  # requests whose grammar is not compiled yet
        self._prompt_logprobs: set[Request] = set()  # with prompt logprobs still to compute
        logger.info("engine ready: %s, %d KV blocks of %d tokens, max_model_len %d, tensor parallel %d",
                    self.model_config.architecture, num_blocks, config.block_size, model_len,
                    config.tensor_parallel_size)

    def _load_draft(self, model_len: int) -> LoadedDraft | None:
        """The draft model (speculative_config.model), checked against this one; None
        without one."""
        spec = self.config.speculative_config
        if spec is None or spec.method != "draft_model":
            return None
        return load_draft(self.config, self.model_config, model_len)

    def _speculator(self, num_blocks: int, model_len: int, draft: LoadedDraft | None) -> Speculator | None:
        spec = self.config.speculative_config
        if spec is None:
            return None
        if self.config.async_scheduling:
            logger.info("speculative decoding: steps run synchronously (each step's drafts follow "
                        "the tokens the last one accepted); async_scheduling is not used")
        proposer = None
        if draft is not None:
            proposer = DraftModelProposer(draft, self.config, num_blocks, self.kv)
        return Speculator(spec, model_len, proposer)

    def _allocate_caches(self, num_blocks: int, kv_allocator: KVAllocator | None,
                         keep_files: bool) -> list[torch.Tensor]:
        config, dtype = self.config, TORCH_DTYPES[self.config.dtype]
        if self.tp is None:
            return [allocate_kv_cache(self.model_config, num_blocks, config.block_size, dtype,
                                      config.device, kv_allocator)]
        if config.device == "cpu":
            shape = kv_cache_shape(self.model_config, num_blocks, config.block_size, self.shard.num_kv_heads)
            self._group.files, caches = shared_cache.create_rank_caches(shape, dtype, self.shard.size)
            self.tp.attach_caches(self._group.files, num_blocks)
        else:
            caches = [allocate_kv_cache(self.model_config, num_blocks, config.block_size, dtype,
                                        config.device, num_kv_heads=self.shard.num_kv_heads)]
            self.tp.attach_caches(None, num_blocks)
        self.tp.wait_ready()
        if not keep_files:
            shared_cache.unlink(self._group.files)
            self._group.files = []
        return caches

    @property
    def tp(self) -> TPDriver | None:
        """The tensor-parallel driver (None at tensor_parallel_size 1)."""
        return self._group.tp

    @property
    def kv_head_ranges(self) -> list[tuple[int, int]]:
        """The model's KV heads [start, end) each rank's cache holds, rank 0 first."""
        size, heads = self.shard.size, self.model_config.num_kv_heads
        return [kv_head_range(heads, size, rank) for rank in range(size)]

    @property
    def kv_cache_files(self) -> list[str]:
        """The rank caches' files, kept for a transport to map (keep_cache_files)."""
        return list(self._group.files)

    def close(self) -> None:
        """Stop the follower ranks and remove the cache files (nothing at TP 1), and
        the grammar compile threads. The engine is unusable afterwards; also run at
        garbage collection and exit."""
        self._finalizer()

    def _pool_blocks(self, backend: AttentionBackend, dtype: torch.dtype, model_len: int,
                     draft: LoadedDraft | None) -> int:
        """On CUDA, the draft model's weights, activations and KV per block are counted;
        on CPU kv_cache_memory_gib is the target's KV alone (a draft's cache is extra)."""
        config = self.config
        if config.device.startswith("cuda") and self.tp is not None:
            # The profiling forward would need the followers' collectives.
            raise ValueError("set num_kv_blocks with tensor_parallel_size > 1 on CUDA: the KV pool "
                             "is not sized by profiling there yet")
        if config.device.startswith("cuda"):
            spec = config.speculative_config
            # A speculating request samples a row per draft and one after them.
            rows = config.max_num_seqs * (1 + (spec.num_speculative_tokens if spec is not None else 0))
            return profile_num_kv_blocks(
                self.model, self.model_config, backend, config.device, dtype, config.block_size,
                config.max_num_batched_tokens, model_len, rows, config.gpu_memory_utilization,
                () if draft is None else [(draft.model, draft.config, draft.backend)])
        # A rank holds only its own KV heads.
        block_bytes = (self.model_config.kv_bytes_per_token(dtype.itemsize) * config.block_size
                       * self.shard.num_kv_heads // self.model_config.num_kv_heads)
        num_blocks = int(config.kv_cache_memory_gib * 2**30 // block_bytes)
        if num_blocks < 1:
            raise ValueError(f"kv_cache_memory_gib={config.kv_cache_memory_gib} is too small for "
                             f"one KV block ({block_bytes} bytes)")
        return num_blocks

    def _capture_cuda_graphs(self, backend: AttentionBackend, model_len: int) -> None:
        if backend.name != "triton":
            logger.info("no CUDA graphs: the %r attention backend synchronises with the host", backend.name)
            return
        from engine.cuda_graphs import CudaGraphRunner

        rows, spec = None, self.config.speculative_config
        if spec is not None:  # verify steps replay them with a row per token: the last one and the drafts
            rows = min(self.config.max_num_seqs * (spec.num_speculative_tokens + 1), self.config.max_num_batched_tokens)
        graphs = CudaGraphRunner(self.model, backend, self.config.max_num_seqs, model_len,
                                 self.config.block_size, torch.device(self.config.device), rows)
        graphs.capture()
        self.runner.graphs = graphs

    def _new_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                     priority: int = 0, resumed: int = 0) -> Request:
        vocab = self.model_config.vocab_size
        bad = [t for t in prompt_token_ids if not (isinstance(t, int) and 0 <= t < vocab)]
        if bad:
            raise ValueError(f"prompt token ids must be integers in [0, {vocab}), got {bad[:5]}")
        outside = params.out_of_vocab(vocab)
        if outside is not None:
            raise SamplingParamsError(outside[0], f"token ids must be in [0, {vocab}), got {outside[1]}")
        if not (isinstance(resumed, int) and 0 <= resumed < len(prompt_token_ids)):
            raise ValueError(f"resumed must be in [0, {len(prompt_token_ids)}), got {resumed!r}")
        request = Request(request_id, list(prompt_token_ids), params, priority=priority)
        if params.seed is not None:
            request.generator = make_generator(params.seed, self.config.device)
            request.keyed_draws = self.speculator is not None
        if params.structured_outputs is not None:
            request.grammar = self._grammar_state(params, prompt_token_ids[len(prompt_token_ids) - resumed:])
            # A compile that is over (a cache hit, or a description xgrammar refused at
            # once) is judged here, before the request is queued: a ValueError then
            # changes nothing.
            request.grammar.ready()
            error = request.grammar.error()
            if error is not None:
                raise error
            # Each token's mask needs the one before it on the host: no step ahead.
            request.reads_history_until = math.inf
        return request

    def _grammar_state(self, params: SamplingParams, resumed: list[int]) -> Any:
        from engine.structured.compiler import GrammarCompiler  # imports xgrammar
        from engine.structured.matcher import GrammarState

        if self._group.grammars is None:
            self._group.grammars = GrammarCompiler(self.config.model, self.model_config.vocab_size,
                                                   self.model_config.eos_token_ids)
        return GrammarState(self._group.grammars.compile(params.structured_outputs), resumed)

    def _track_grammar(self, request: Request) -> Request:
        if request.grammar_pending:
            self._compiling[request.request_id] = request
        return request

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    priority: int = 0, resumed: int = 0) -> Request:
        """Queue a request; raises ValueError (and changes nothing) if it can never run.

        `resumed`: the last this many prompt tokens are the request's own output from an
        earlier worker (a failover): its grammar, if it has one, has accepted them. A
        grammar compiles in the background; the request waits for it without holding
        up others, and a grammar that fails to compile fails it at the next step.

        params.n > 1 (parallel sampling): returns the group's prompt request, which the
        caller never sees again; its `sequences` are the n requests that run, sequence
        i named child_request_id(request_id, i) with params.child(i)
        (engine/fork_groups.py)."""
        if params.n > 1:
            prompt, sequences = self._new_group(request_id, prompt_token_ids, params, priority, resumed)
            self.scheduler.add_group(prompt, sequences)
            for sequence in sequences:
                self._track_grammar(sequence)
            return prompt
        request = self._new_request(request_id, prompt_token_ids, params, priority, resumed)
        self.scheduler.add_request(request)
        if request.needs_prompt_logprobs:
            self._prompt_logprobs.add(request)
        return self._track_grammar(request)

    def _new_group(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                   priority: int, resumed: int) -> tuple[Request, list[Request]]:
        """A group's prompt request (every prompt token but the last, prefill only) and
        its sequences, checked as add_request checks one request."""
        if params.prompt_logprobs is not None:  # each sequence computes only the last prompt token
            raise SamplingParamsError("prompt_logprobs", "is not supported with n > 1 (ask with n=1)")
        sequences = [self._new_request(child_request_id(request_id, i), prompt_token_ids, params.child(i),
                                       priority, resumed) for i in range(params.n)]
        prompt = Request(request_id, list(prompt_token_ids[:-1]), SamplingParams(max_tokens=1), priority=priority)
        prompt.prefill_only = True
        self.scheduler.check_group(prompt, sequences)
        return prompt, sequences

    # --- disaggregation: decode worker side ------------------------------------------

    def add_remote_prefill_request(self, request_id: str, prompt_token_ids: list[int],
                                   params: SamplingParams, priority: int = 0,
                                   resumed: int = 0) -> Request | None:
        """Reserve blocks for the whole prompt and wait for a prefill worker to write
        its KV. Returns the request (its blocks: kv.block_ids(request_id); tokens
        already cached here: request.num_cached_tokens), or None when the blocks do not
        fit now (prefill locally with add_request instead). Raises ValueError for a
        request that could never run. `resumed`: as for add_request."""
        if len(prompt_token_ids) < 2:
            raise ValueError("a remote prefill needs a prompt of at least 2 tokens")
        if params.prompt_logprobs is not None:  # a prefill worker sends KV, not logits
            raise ValueError("prompt_logprobs needs the prompt prefilled locally, not remotely")
        if params.n > 1:  # the group's prompt request takes the KV; its sequences fork on arrival
            prompt, sequences = self._new_group(request_id, prompt_token_ids, params, priority, resumed)
            if not self.scheduler.reserve_for_remote_prefill(prompt):
                return None
            self.scheduler.join_group(prompt, sequences)
            for sequence in sequences:
                self._track_grammar(sequence)
            return prompt
        request = self._new_request(request_id, prompt_token_ids, params, priority, resumed)
        return self._track_grammar(request) if self.scheduler.reserve_for_remote_prefill(request) else None

    def remote_kv_arrived(self, request_id: str) -> None:
        """Every prompt token's KV but the last's is in the reserved blocks."""
        self.scheduler.remote_kv_arrived(self.scheduler.requests[request_id])

    def remote_kv_failed(self, request_id: str) -> None:
        """Prefill locally instead, in new blocks: the request lets go of those it
        reserved. Hold (hold_blocks) and fence any a remote write may still land in
        first: they stay out of use until release_blocks and unfence_blocks."""
        self.scheduler.remote_kv_failed(self.scheduler.requests[request_id])

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

    def add_prefill_request(self, request_id: str, prompt_token_ids: list[int]) -> Request:
        """Compute the KV of these tokens and keep it (status PREFILLED, reported in
        StepOutput.finished) until release_prefilled(). Never samples."""
        request = self._new_request(request_id, prompt_token_ids, SamplingParams(max_tokens=1))
        request.prefill_only = True
        self.scheduler.add_request(request)
        return request

    def release_prefilled(self, request_id: str) -> None:
        self.scheduler.release_prefilled(request_id)

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
        spec = None
        if self.speculator is not None:  # a copy: the speculator's counters keep moving
            live = self.speculator.stats
            spec = dataclasses.replace(live, accepted_per_position=list(live.accepted_per_position))
        return EngineStats(self.kv.pool.num_blocks, self.kv.num_free_blocks, len(self.scheduler.running),
                           self.scheduler.num_waiting, len(self._compiling),
                           (os.getpid(), *(self.tp.pids if self.tp else ())), self.scheduler.num_preemptions, spec)

    def collect_kv_events(self, max_per_block: int) -> None:
        """Keep prefix-cache events from now on, for take_kv_events(): at most
        max_per_block per KV block between two takes; beyond that they are dropped
        (nobody is taking them) and the next take says so."""
        pool = self.kv.pool
        pool.events_limit = max_per_block * pool.num_blocks
        if pool.events is None:
            pool.events = []

    def take_kv_events(self) -> tuple[list[list], bool]:
        """The events since the last take, in order ([block hash, True = cached / False
        = evicted]), and whether some were dropped since (start the index over)."""
        pool = self.kv.pool
        events, lost = pool.events or [], pool.events_lost
        if pool.events is not None:
            pool.events = []
        pool.events_lost = False
        return events, lost

    def abort(self, request_ids: list[str]) -> list[Request]:
        return self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def finish_stopped(self, request_ids: list[str]) -> list[Request]:
        """Finish requests that hit a stop string (detected outside the core)."""
        return self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_STOPPED)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished or self._in_flight is not None

    def has_runnable(self) -> bool:
        """Requests a step can advance: running, or queued (waiting for blocks, a slot,
        or ready to resume), or a launched step to collect; not those only waiting for
        remote KV."""
        return bool(self.scheduler.running) or self.scheduler.num_waiting > 0 or self._in_flight is not None

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
        if self._compiling:
            self._check_grammars()
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
                    self._run(self.speculator.fill, queued, out)
                rows = self._prompt_rows(out)
                launch = self.runner.launch if rows is None else functools.partial(self.runner.launch,
                                                                                   prompt_rows=rows)
                launched = self._run(launch, queued, out.scheduled, self._block_tables(out),
                                     in_flight[1] if in_flight else None, out.block_copies)
                if not self.config.async_scheduling or self.speculator is not None:
                    return self._finish_step((out, launched), queued)
                self._in_flight = (out, launched)
            elif not in_flight and self._compiling:  # nothing to do but wait for a grammar
                next(iter(self._compiling.values())).grammar.wait(0.01)
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

    def _check_grammars(self) -> None:
        """Forget requests whose grammar has compiled. One whose compile failed is
        reported (RequestsFailed, at its own fault, naming its parameter), one per step
        so that each gets its own message; the caller ends it as it ends any failed
        request (a decode worker first lets a remote KV write into its blocks finish).
        Until then it stays queued, never admitted (it has no matcher)."""
        for request_id, request in list(self._compiling.items()):
            if request.status.finished:  # aborted meanwhile
                del self._compiling[request_id]
                continue
            timeout = self.config.grammar_compile_timeout_s
            try:
                if not request.grammar.ready():
                    if time.monotonic() - request.grammar.created <= timeout:
                        continue
                    # The compile thread cannot be stopped; it finishes into the cache.
                    error = ValueError(f"its grammar did not compile within {timeout:g} s "
                                       "(engine.grammar_compile_timeout_s): the schema is too large or complex")
                else:
                    error = request.grammar.error()
            except ValueError as exc:  # its resumed tokens do not follow the grammar
                error = exc
            del self._compiling[request_id]
            if error is not None:
                raise RequestsFailed(str(error), [request_id], at_fault=True,
                                     param=getattr(error, "param", "structured_outputs"))

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
        tokens, num_accepted, logprobs = self.speculator.accepted(out, sampled)
        self.speculator.record(out, num_accepted)
        sampling = [s.request for s in out.scheduled if s.samples]
        before = [r.num_output_tokens for r in sampling]
        advanced, finished = self.scheduler.update(out, tokens, num_accepted)
        for request, n, entries in zip(sampling, before, logprobs):
            if request.sampling_params.logprobs is not None:  # one per token it took (a stop drops the rest)
                request.output_logprobs += entries[:request.num_output_tokens - n]
        return StepOutput(advanced, finished, out.num_tokens, len(out.scheduled))


class _GroupResources:
    """What close() releases; apart from the engine so its finalizer does not keep the
    engine alive."""

    def __init__(self) -> None:
        self.tp: TPDriver | None = None
        self.files: list[str] = []
        self.grammars: Any = None  # engine.structured.compiler.GrammarCompiler, from the first grammar

    def close(self) -> None:
        if self.grammars is not None:
            self.grammars.close()
        if self.tp is not None:
            self.tp.close()
        shared_cache.unlink(self.files)
        self.files = []
